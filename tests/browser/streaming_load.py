"""A background load for the dashboard tests: threads that each send streaming completions (ignore_eos, many
tokens) one after another until the load is stopped; a stopped stream is closed mid-way (the server aborts it)."""

from __future__ import annotations

import threading

import httpx


class StreamingLoad:
    def __init__(self, url: str, model: str, num_streams: int = 4, max_tokens: int = 300,
                 api_key: str | None = None) -> None:
        self.url = url + "/v1/completions"
        self.body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True,
                     "ignore_eos": True, "temperature": 1.0}
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.stop_event = threading.Event()
        self.threads = [threading.Thread(target=self._run, name=f"load-{i}", daemon=True)
                        for i in range(num_streams)]
        self.num_chunks = 0
        self.errors: list[str] = []

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.stop_event.is_set():
                try:
                    self._one(client)
                except httpx.HTTPError as e:
                    self.errors.append(repr(e))

    def _one(self, client: httpx.Client) -> None:
        with client.stream("POST", self.url, json=self.body, headers=self.headers) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if self.stop_event.is_set():
                    return
                if line.startswith("data: {"):
                    self.num_chunks += 1

    def __enter__(self) -> StreamingLoad:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(timeout=60)
