// Calls to the server's API: the key (kept in this browser's localStorage), errors, and SSE read from
// fetch's ReadableStream.

const KEY_ITEM = "llmserve-api-key";

export class AuthError extends Error {}

export class APIError extends Error {}

export function apiKey() {
  return localStorage.getItem(KEY_ITEM) || "";
}

export function setApiKey(key) {
  localStorage.setItem(KEY_ITEM, key);
}

function headers() {
  const out = { "Content-Type": "application/json" };
  const key = apiKey();
  if (key) out.Authorization = `Bearer ${key}`;
  return out;
}

async function checked(response) {
  if (response.ok) return response;
  const text = await response.text();
  let message = text;
  try {
    message = JSON.parse(text).error?.message ?? text;
  } catch (_) { /* not JSON: the text itself */ }
  if (response.status === 401) throw new AuthError(message);
  throw new APIError(`${response.status}: ${message}`);
}

export async function getJSON(path) {
  const response = await checked(await fetch(path, { headers: headers() }));
  return response.json();
}

export async function postStream(path, body, signal) {
  return checked(await fetch(path, { method: "POST", headers: headers(), body: JSON.stringify(body), signal }));
}

// Calls onEvent(parsed JSON) for each `data:` event until [DONE] or the end of the body.
export async function readSSE(response, onEvent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    const events = buffer.split(/\r?\n\r?\n/);
    buffer = events.pop();
    for (const event of events) {
      if (dispatch(event, onEvent)) return;
    }
  }
}

function dispatch(event, onEvent) {
  for (const line of event.split(/\r?\n/)) {
    if (!line.startsWith("data:")) continue;
    const data = line.slice(5).trim();
    if (data === "[DONE]") return true;
    const parsed = JSON.parse(data);
    if (parsed.error) throw new APIError(parsed.error.message ?? JSON.stringify(parsed.error));
    onEvent(parsed);
  }
  return false;
}
