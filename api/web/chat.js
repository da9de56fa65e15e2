// Chat: one conversation at a time, streamed from `POST /v1/chat/completions`, kept in localStorage.
// A long prompt shows its prefill progress (the stream's `: prefill_progress {...}` comments) as a
// bar until the first token, with an ETA once a rate is measured (eta.js); Stop cancels on the
// server (`POST /v1/cancel/{id}`) and aborts the fetch. The sampling settings a request runs with
// are shown under the picker (sampling.js); only a typed temperature is sent.

import { call, openStream, readEvents } from "./api.js";
import { h, seconds } from "./dom.js";
import { PrefillEta } from "./eta.js";
import { setMarkdown } from "./markdown.js";
import { chosenTemperature, samplingLine } from "./sampling.js";
import { currentId, loadConversations, newConversation, saveConversations, setCurrentId } from "./store.js";

const $ = (id) => document.getElementById(id);
const PROGRESS = "prefill_progress ";
const MAX_TOKENS = "shoal.maxTokens";
const TEMPERATURE = "shoal.temperature";
const STOP_GRACE_MS = 1500; // after a cancel, how long the stream may take to end by itself (with its usage)

/** The bubble of one assistant answer: reasoning, prefill bar, text and the line of figures. */
class AnswerView {
  constructor(message) {
    this.message = message;
    this.reasoning = h("details.reasoning", { hidden: true }, h("summary", {}, "Reasoning"), h("div.md"));
    this.progressSlot = h("div.progress-slot");
    this.body = h("div.md.body");
    this.meta = h("div.meta");
    this.el = h("div.msg.assistant", {}, this.reasoning, this.progressSlot, this.body, this.meta);
    this.bar = null;
    this.pending = false;
    this.draw();
  }

  draw() {
    const m = this.message;
    if (m.reasoning) {
      this.reasoning.hidden = false;
      setMarkdown(this.reasoning.querySelector(".md"), m.reasoning);
    }
    setMarkdown(this.body, m.content || "");
    this.meta.replaceChildren(...this.figures());
  }

  /** Redraw at most once a frame while tokens stream in. */
  schedule() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => {
      this.pending = false;
      this.draw();
    });
  }

  figures() {
    const m = this.message;
    const parts = [];
    if (m.error) parts.push(h("span.error", {}, m.error));
    if (m.stopped) parts.push(h("span.stopped", {}, "stopped"));
    const s = m.stats;
    if (s && s.usage) {
      const u = s.usage;
      const cached = u.prompt_tokens_details && u.prompt_tokens_details.cached_tokens;
      parts.push(
        h("span.usage", {}, `${u.prompt_tokens} prompt${cached ? ` (${cached} cached)` : ""} + ${u.completion_tokens} tokens`),
      );
      if (s.decode_s > 0 && u.completion_tokens > 1) {
        parts.push(h("span.speed", {}, `${((u.completion_tokens - 1) / s.decode_s).toFixed(1)} tok/s`));
      }
    }
    if (s && s.ttft_s !== null && s.ttft_s !== undefined) parts.push(h("span.ttft", {}, `first token ${seconds(s.ttft_s)}`));
    if (!parts.length && !m.content && !m.reasoning && !s) parts.push(h("span.muted.waiting", {}, "waiting…"));
    return parts;
  }

  /** One prefill event: move the bar, with an ETA once a rate is measured (`PrefillEta`). */
  progress({ processed_tokens: done, total_tokens: total }) {
    if (!this.bar) {
      this.fill = h("div.bar-fill");
      this.label = h("span.prefill-label");
      this.bar = h(
        "div.prefill",
        { role: "progressbar", "aria-label": "Processing prompt", "aria-valuemin": 0 },
        h("div.bar", {}, this.fill),
        this.label,
      );
      this.progressSlot.replaceChildren(this.bar);
      this.eta = new PrefillEta(this.message.model);
    }
    this.bar.setAttribute("aria-valuemax", String(total));
    this.bar.setAttribute("aria-valuenow", String(done));
    this.fill.style.width = `${total > 0 ? Math.min(100, (100 * done) / total).toFixed(1) : 0}%`;
    const left = this.eta.see(done, total, performance.now());
    const eta = left === null ? "" : ` · ETA ${seconds(left) || "0 ms"}`;
    this.label.textContent = `Processing prompt: ${done} / ${total} tokens${eta}`;
  }

  clearProgress() {
    if (this.bar) this.progressSlot.replaceChildren();
    this.bar = null;
  }
}

export class Chat {
  constructor() {
    this.conversations = loadConversations();
    this.current = this.conversations.find((c) => c.id === currentId()) || null;
    if (!this.current) this.startNew();
    this.active = null;
    $("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        this.send();
      }
    });
    $("stop").addEventListener("click", () => this.stop());
    $("new-chat").addEventListener("click", () => {
      this.startNew();
      this.renderAll();
    });
    $("model-select").addEventListener("change", () => {
      this.current.model = $("model-select").value;
      this.save();
      this.showSampling();
    });
    const limit = localStorage.getItem(MAX_TOKENS);
    if (limit) $("max-tokens").value = limit;
    $("max-tokens").addEventListener("change", () => localStorage.setItem(MAX_TOKENS, $("max-tokens").value));
    this.models = new Map(); // id -> its `/v1/models` entry
    $("temperature").value = localStorage.getItem(TEMPERATURE) || "";
    $("temperature").addEventListener("input", () => {
      localStorage.setItem(TEMPERATURE, $("temperature").value);
      this.showSampling();
    });
    this.renderAll();
  }

  startNew() {
    const empty = this.conversations.find((c) => !c.messages.length);
    this.current = empty || newConversation(this.current ? this.current.model : "");
    if (!empty) this.conversations.unshift(this.current);
    setCurrentId(this.current.id);
    this.save();
  }

  save() {
    this.current.updated = Date.now();
    saveConversations(this.conversations);
  }

  /** The models requests may name now (`GET /v1/models`), in the picker. */
  async loadModels() {
    let ids = [];
    try {
      const models = (await call("GET", "/v1/models")).data;
      this.models = new Map(models.map((m) => [m.id, m]));
      ids = models.map((m) => m.id);
    } catch (error) {
      $("model-hint").textContent = error.message;
      return;
    }
    const select = $("model-select");
    const wanted = this.current.model || select.value;
    const options = ids.map((id) => h("option", { value: id }, id));
    select.replaceChildren(...(options.length ? options : [h("option", { value: "" }, "no model running")]));
    if (ids.includes(wanted)) select.value = wanted;
    $("model-hint").textContent = "";
    $("send").disabled = !ids.length && !this.active;
    this.showSampling();
  }

  /** The effective sampling settings of the chosen model, with the typed temperature. */
  showSampling() {
    const model = this.models.get($("model-select").value);
    const line = model ? samplingLine(model.sampling_defaults, chosenTemperature($("temperature"))) : [];
    $("sampling-info").replaceChildren(...line);
  }

  renderAll() {
    this.renderList();
    this.renderMessages();
  }

  renderList() {
    const items = this.conversations.map((c) =>
      h(
        "li",
        { class: c.id === this.current.id ? "active" : null },
        h("button.open", { type: "button", title: c.title, onclick: () => this.open(c) }, c.title),
        h("button.forget", { type: "button", title: "delete this conversation", onclick: () => this.forget(c) }, "×"),
      ),
    );
    $("conversation-list").replaceChildren(...items);
  }

  renderMessages() {
    const box = $("messages");
    box.replaceChildren(
      ...this.current.messages.map((m) => {
        if (m.role === "assistant") return new AnswerView(m).el;
        const body = h("div.md.body");
        setMarkdown(body, m.content);
        return h("div.msg.user", {}, body);
      }),
    );
    if (!this.current.messages.length) box.append(h("p.empty", {}, "Ask the cluster something."));
    box.scrollTop = box.scrollHeight;
    if (this.current.model) $("model-select").value = this.current.model;
  }

  open(conversation) {
    if (this.active) return;
    this.current = conversation;
    setCurrentId(conversation.id);
    this.renderAll();
  }

  forget(conversation) {
    if (this.active && conversation === this.current) return;
    this.conversations = this.conversations.filter((c) => c !== conversation);
    if (conversation === this.current) this.startNew();
    this.save();
    this.renderAll();
  }

  setBusy(busy) {
    $("send").hidden = busy;
    $("stop").hidden = !busy;
  }

  async send() {
    const text = $("prompt").value;
    const model = $("model-select").value;
    if (this.active || !text.trim()) return;
    if (!model) {
      $("model-hint").textContent = "no model to ask: launch one first";
      return;
    }
    const conversation = this.current;
    conversation.model = model;
    if (!conversation.messages.length) conversation.title = text.trim().slice(0, 48);
    const history = conversation.messages
      .filter((m) => !(m.role === "assistant" && (m.error || !m.content)))
      .map((m) => ({ role: m.role, content: m.content }));
    conversation.messages.push({ role: "user", content: text });
    const answer = { role: "assistant", content: "", reasoning: "", model };
    conversation.messages.push(answer);
    $("prompt").value = "";
    this.save();
    this.renderAll();
    const view = new AnswerView(answer);
    $("messages").lastElementChild.replaceWith(view.el);
    await this.stream(model, [...history, { role: "user", content: text }], answer, view);
  }

  async stream(model, messages, answer, view) {
    const controller = new AbortController();
    this.active = { controller, id: null, answer };
    this.setBusy(true);
    const started = performance.now();
    let first = null;
    let usage = null;
    let finish = null;
    const box = $("messages");
    const follow = () => {
      if (box.scrollHeight - box.scrollTop - box.clientHeight < 120) box.scrollTop = box.scrollHeight;
    };
    try {
      const body = { model, messages, stream: true, stream_options: { include_usage: true } };
      const limit = Number.parseInt($("max-tokens").value, 10);
      if (limit > 0) body.max_tokens = limit;
      const temperature = chosenTemperature($("temperature"));
      if (temperature !== null) body.temperature = temperature;
      const response = await openStream("/v1/chat/completions", body, controller.signal);
      for await (const event of readEvents(response)) {
        if (event.comment !== undefined) {
          if (event.comment.startsWith(PROGRESS) && first === null) {
            view.progress(JSON.parse(event.comment.slice(PROGRESS.length)));
            follow();
          }
          continue;
        }
        if (event.data === "[DONE]") break;
        const chunk = JSON.parse(event.data);
        if (chunk.error) {
          answer.error = chunk.error.message;
          break;
        }
        if (chunk.id && this.active) this.active.id = chunk.id;
        if (chunk.usage) usage = chunk.usage;
        const choice = (chunk.choices || [])[0];
        if (!choice) continue;
        finish = choice.finish_reason || finish;
        const delta = choice.delta || {};
        if (delta.content || delta.reasoning_content) {
          if (first === null) {
            first = performance.now();
            view.clearProgress();
          }
          answer.content += delta.content || "";
          answer.reasoning += delta.reasoning_content || "";
          view.schedule();
          follow();
        }
      }
    } catch (error) {
      if (error.name === "AbortError") answer.stopped = true;
      else answer.error = error.message;
    } finally {
      const ended = performance.now();
      view.clearProgress();
      answer.stats = {
        usage,
        finish,
        ttft_s: first === null ? null : (first - started) / 1000,
        decode_s: first === null ? null : (ended - first) / 1000,
      };
      this.active = null;
      this.setBusy(false);
      this.save();
      view.draw();
      follow();
      $("prompt").focus();
    }
  }

  /** Cancel on the server (the completion id came with the first chunk), then stop reading. */
  async stop() {
    const active = this.active;
    if (!active) return;
    active.answer.stopped = true;
    if (active.id) {
      try {
        await call("POST", `/v1/cancel/${encodeURIComponent(active.id)}`);
      } catch (error) {
        console.debug("cancel:", error.message); // already finished: nothing to cancel
      }
    }
    setTimeout(() => active.controller.abort(), active.id ? STOP_GRACE_MS : 0);
  }
}
