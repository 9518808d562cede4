"""What the HTTP fronts share (the server, the router, the Ray Serve ingress): errors in OpenAI's shape,
SSE framing, the dashboard's page and state, and running a service on a bound socket. Imports nothing from
the engine, so a router loads without torch."""
