// The playground: chat (the server applies the model's chat template) and raw completion, streamed
// over SSE; Stop aborts the fetch, and the server aborts the engine request when the client leaves.

import { APIError, AuthError, getJSON, postStream, readSSE, setApiKey } from "./api.js";
import { FormError, requestFields } from "./params.js";
import { AnswerView, chunkLogprobs, installTooltip } from "./render.js";

const $ = (id) => document.getElementById(id);

class Playground {
  constructor() {
    this.mode = "chat";
    this.model = undefined;
    this.messages = [];
    this.controller = null;
    this.afterKey = null;
  }

  start() {
    installTooltip($("tooltip"));
    for (const tab of document.querySelectorAll("#modes button")) {
      tab.addEventListener("click", () => this.setMode(tab.dataset.mode));
    }
    $("send").addEventListener("click", () => this.send());
    $("stop").addEventListener("click", () => this.controller?.abort());
    $("clear").addEventListener("click", () => this.clear());
    $("change-key").addEventListener("click", () => this.askForKey("Enter the server's API key.", null));
    $("key-form").addEventListener("submit", (event) => this.saveKey(event));
    for (const id of ["user-input", "prompt"]) {
      $(id).addEventListener("keydown", (e) => e.key === "Enter" && e.ctrlKey && this.send());
    }
    this.loadModel();
  }

  async loadModel() {
    try {
      this.model = (await getJSON("/v1/models")).data[0]?.id;
      $("model-name").textContent = this.model ?? "(no model)";
      document.body.dataset.ready = "true";
    } catch (error) {
      if (error instanceof AuthError) this.askForKey(error.message, () => this.loadModel());
      else this.setStatus(error.message);
    }
  }

  setMode(mode) {
    this.mode = mode;
    for (const tab of document.querySelectorAll("#modes button")) {
      tab.setAttribute("aria-selected", String(tab.dataset.mode === mode));
    }
    for (const pane of document.querySelectorAll("[data-pane]")) pane.hidden = pane.dataset.pane !== mode;
  }

  askForKey(reason, then) {
    this.afterKey = then;
    $("key-reason").textContent = reason;
    $("key-prompt").hidden = false;
    $("api-key").focus();
  }

  saveKey(event) {
    event.preventDefault();
    setApiKey($("api-key").value.trim());
    $("key-prompt").hidden = true;
    const then = this.afterKey;
    this.afterKey = null;
    (then ?? (() => this.loadModel()))();
  }

  clear() {
    this.messages = [];
    $("conversation").replaceChildren();
    $("completion-output").replaceChildren();
  }

  send() {
    if (this.controller) return;
    try {
      if (this.mode === "chat") this.sendChat();
      else this.sendCompletion();
    } catch (error) {
      if (!(error instanceof FormError)) throw error;
      this.setStatus(error.message);
    }
  }

  sendChat() {
    const fields = requestFields("chat", this.model);
    const text = $("user-input").value;
    const system = $("system").value.trim();
    const history = [...this.messages, { role: "user", content: text }];
    const messages = system ? [{ role: "system", content: system }, ...history] : history;
    const userTurn = turn($("conversation"), "user", text);
    const answerTurn = turn($("conversation"), "assistant", "");
    $("user-input").value = "";
    const undo = () => {
      userTurn.remove();
      answerTurn.remove();
      $("user-input").value = text;
    };
    const done = (view) => {
      this.messages = [...history, { role: "assistant", content: view.plainText() }];
    };
    this.stream("/v1/chat/completions", { ...fields, messages }, this.answerView(answerTurn, fields), undo, done);
  }

  sendCompletion() {
    const fields = requestFields("completion", this.model);
    const output = $("completion-output");
    output.replaceChildren();
    const view = this.answerView(output, fields);
    this.stream("/v1/completions", { ...fields, prompt: $("prompt").value }, view, () => output.replaceChildren());
  }

  answerView(container, fields) {
    const view = new AnswerView(container);
    view.expectsJSON = Boolean(fields.response_format || fields.structured_outputs);
    return view;
  }

  // Reads the stream into `view`, then `done` (also after Stop: the partial answer stays in the history);
  // on a 401, `undo` then the key prompt, and the same send once a key is in.
  async stream(path, body, view, undo, done = () => {}) {
    this.setBusy(new AbortController());
    let finish = "stop";
    try {
      const response = await postStream(path, body, this.controller.signal);
      await readSSE(response, (chunk) => {
        finish = this.onChunk(chunk, view) ?? finish;
      });
      view.finish(finish);
      done(view);
    } catch (error) {
      this.onStreamError(error, view, undo);
      if (error.name === "AbortError") done(view);
    } finally {
      this.setBusy(null);
    }
  }

  onChunk(chunk, view) {
    if (chunk.usage) view.usage = chunk.usage;
    const choice = chunk.choices?.[0];
    if (!choice) return null;
    const text = (choice.delta ? choice.delta.content : choice.text) ?? "";
    view.add(text, chunkLogprobs(choice));
    return choice.finish_reason;
  }

  onStreamError(error, view, undo) {
    if (error.name === "AbortError") {
      view.finish("abort");
    } else if (error instanceof AuthError) {
      undo();
      this.askForKey(error.message, () => this.send());
    } else if (error instanceof APIError || error instanceof TypeError) {
      view.fail(error.message);
    } else {
      throw error;
    }
  }

  setBusy(controller) {
    this.controller = controller;
    $("send").disabled = controller !== null;
    $("stop").disabled = controller === null;
    this.setStatus(controller ? "generating…" : "");
  }

  setStatus(text) {
    $("status").textContent = text;
  }
}

function turn(container, role, text) {
  const el = document.createElement("div");
  el.className = `turn ${role}`;
  el.dataset.role = role;
  if (text) el.textContent = text;
  container.append(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

new Playground().start();
