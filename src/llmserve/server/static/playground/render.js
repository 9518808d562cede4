// One streamed answer: its text as token spans (logprobs on hover) and the line of numbers under it.

// Per token {token, logprob, top: [{token, logprob}]}, from a chat or a completion chunk's choice.
export function chunkLogprobs(choice) {
  const lp = choice.logprobs;
  if (!lp) return [];
  if (Array.isArray(lp.content)) {
    return lp.content.map((t) => ({ token: t.token, logprob: t.logprob, top: t.top_logprobs ?? [] }));
  }
  return (lp.tokens ?? []).map((token, i) => ({
    token,
    logprob: lp.token_logprobs[i],
    top: Object.entries(lp.top_logprobs?.[i] ?? {}).map(([t, logprob]) => ({ token: t, logprob })),
  }));
}

export class AnswerView {
  constructor(container) {
    this.text = append(container, "div", "answer");
    this.stats = append(container, "div", "stats");
    this.start = performance.now();
    this.firstTokenAt = null;
    this.lastTokenAt = null;
    this.numTokens = 0; // tokens received: from the logprobs where there are some, else one a chunk
    this.usage = null;
    this.expectsJSON = false;
  }

  // A chunk's text: one span per chunk; with one token in the chunk, that token's logprobs on hover.
  add(text, logprobs) {
    if (!text && !logprobs.length) return;
    const now = performance.now();
    this.firstTokenAt ??= now;
    this.lastTokenAt = now;
    this.numTokens += Math.max(1, logprobs.length);
    const span = append(this.text, "span", logprobs.length ? "tok has-logprobs" : "tok");
    span.textContent = text;
    span.logprobs = logprobs;
  }

  plainText() {
    return this.text.textContent;
  }

  finish(reason) {
    this.stats.textContent = statsLine(this, reason);
    this.stats.dataset.finish = reason;
  }

  fail(message) {
    append(this.text, "div", "error").textContent = message;
    this.finish("error");
  }
}

function append(parent, tag, className) {
  const el = document.createElement(tag);
  el.className = className;
  parent.append(el);
  return el;
}

function statsLine(view, reason) {
  const parts = [];
  if (view.firstTokenAt !== null) parts.push(`TTFT ${ms(view.firstTokenAt - view.start)}`);
  const numTokens = view.usage?.completion_tokens ?? view.numTokens;
  // Over the whole request (TTFT included): chunks read together would make a decode-only rate meaningless.
  const seconds = (view.lastTokenAt - view.start) / 1000;
  if (numTokens > 0 && seconds > 0) parts.push(`${(numTokens / seconds).toFixed(1)} tokens/s`);
  parts.push(`${numTokens} tokens`);
  if (view.usage) {
    const cached = view.usage.prompt_tokens_details?.cached_tokens ?? 0;
    parts.push(`cached prompt tokens ${cached} / ${view.usage.prompt_tokens}`);
  }
  if (view.expectsJSON && reason !== "abort") parts.push(isJSON(view.plainText()) ? "valid JSON" : "not JSON");
  parts.push(reason === "abort" ? "stopped" : `finish: ${reason}`);
  return parts.join(" · ");
}

function isJSON(text) {
  try {
    JSON.parse(text);
    return true;
  } catch (_) {
    return false;
  }
}

function ms(value) {
  return value < 1000 ? `${Math.round(value)} ms` : `${(value / 1000).toFixed(2)} s`;
}

// The tooltip that shows a token's logprob (and the alternatives) while the pointer is on it.
export function installTooltip(tooltip) {
  document.addEventListener("mouseover", (event) => {
    const span = event.target.closest?.(".tok.has-logprobs");
    if (!span) {
      tooltip.hidden = true;
      return;
    }
    tooltip.replaceChildren(...span.logprobs.map(tokenTable));
    const box = span.getBoundingClientRect();
    tooltip.style.left = `${box.left + window.scrollX}px`;
    tooltip.style.top = `${box.bottom + window.scrollY + 4}px`;
    tooltip.hidden = false;
  });
}

function tokenTable(entry) {
  const table = document.createElement("table");
  const rows = [[entry.token, entry.logprob, "chosen"], ...entry.top.map((t) => [t.token, t.logprob, ""])];
  for (const [token, logprob, note] of rows) {
    const row = table.insertRow();
    row.className = note;
    row.insertCell().textContent = JSON.stringify(token);
    const known = typeof logprob === "number";
    row.insertCell().textContent = known ? `logprob ${logprob.toFixed(3)}` : "logprob n/a";
    row.insertCell().textContent = known ? `p ${(100 * Math.exp(logprob)).toFixed(1)}%` : "";
  }
  return table;
}
