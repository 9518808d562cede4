// The request body's sampling and output fields, read from the form in the side panel.

const NUMBER_FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
  "presence_penalty", "frequency_penalty", "seed"];

export class FormError extends Error {}

function byId(id) {
  return document.getElementById(id);
}

function numbers() {
  const out = {};
  for (const name of NUMBER_FIELDS) {
    const value = byId(name).value.trim();
    if (value !== "") out[name] = Number(value);
  }
  return out;
}

function stopStrings() {
  const stops = byId("stop_strings").value.split(",").map((s) => s.trim()).filter(Boolean);
  return stops.length ? { stop: stops } : {};
}

export function jsonSchema() {
  const text = byId("json-schema").value.trim();
  if (!text) return null;
  try {
    return JSON.parse(text);
  } catch (error) {
    throw new FormError(`the JSON schema is not valid JSON: ${error.message}`);
  }
}

function logprobFields(mode) {
  if (!byId("logprobs").checked) return {};
  const top = Number(byId("top_logprobs").value || 0);
  return mode === "chat" ? { logprobs: true, top_logprobs: top } : { logprobs: top };
}

function structuredFields(mode) {
  const schema = jsonSchema();
  if (schema === null) return {};
  if (mode === "chat") {
    return { response_format: { type: "json_schema", json_schema: { name: "playground", schema } } };
  }
  return { structured_outputs: { json: schema } };
}

// Everything but the prompt or the messages.
export function requestFields(mode, model) {
  return {
    model,
    stream: true,
    stream_options: { include_usage: true },
    ignore_eos: byId("ignore_eos").checked,
    ...numbers(),
    ...stopStrings(),
    ...logprobFields(mode),
    ...structuredFields(mode),
  };
}
