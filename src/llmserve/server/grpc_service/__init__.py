"""The gRPC API: llmserve.proto, the modules generated from it, and the service on the HTTP server's engine."""
