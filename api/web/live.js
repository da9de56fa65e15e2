// The dashboard's state, kept live: pushed by this node (`GET /v1/cluster/events`, one event per
// change), or, when the stream cannot be held open (a proxy that buffers, an error), polled from
// `GET /v1/dashboard/state` every POLL_MS while the push is retried now and then.

import { call, openStream, readEvents } from "./api.js";

const POLL_MS = 2000;
const RETRY_PUSH_MS = 15000;
const STALE_MS = 25000; // the push sends at least a keep-alive every 10 s: silence this long is a dead stream

export class Live {
  /** `onState(state)` gets each state; `onMode(mode)` "push", "polling" or "offline". */
  constructor(onState, onMode) {
    this.onState = onState;
    this.onMode = onMode;
    this.mode = "";
  }

  start() {
    this.#loop();
  }

  /** Reconnect now (the API key changed: the open stream was asked with the old one). */
  restart() {
    this.restarting = true;
    if (this.controller) this.controller.abort();
  }

  #setMode(mode) {
    if (mode !== this.mode) {
      this.mode = mode;
      this.onMode(mode);
    }
  }

  async #loop() {
    for (;;) {
      try {
        await this.#push();
      } catch (error) {
        if (error.name !== "AbortError") console.debug("push stream ended:", error.message);
      }
      if (this.restarting) this.restarting = false;
      else await this.#poll(RETRY_PUSH_MS);
    }
  }

  /** Follow the push stream until it ends or goes quiet. */
  async #push() {
    const controller = new AbortController();
    this.controller = controller;
    let watchdog = setTimeout(() => controller.abort(), STALE_MS);
    try {
      const response = await openStream("/v1/cluster/events", undefined, controller.signal);
      for await (const event of readEvents(response)) {
        clearTimeout(watchdog);
        watchdog = setTimeout(() => controller.abort(), STALE_MS);
        if (event.data) {
          this.#setMode("push");
          this.onState(JSON.parse(event.data));
        }
      }
    } finally {
      clearTimeout(watchdog);
      controller.abort();
    }
  }

  /** Poll for `duration` ms (the push is tried again after that). */
  async #poll(duration) {
    const until = Date.now() + duration;
    while (Date.now() < until) {
      try {
        this.onState(await call("GET", "/v1/dashboard/state"));
        this.#setMode("polling");
      } catch {
        this.#setMode("offline");
      }
      await new Promise((resolve) => setTimeout(resolve, POLL_MS));
    }
  }
}
