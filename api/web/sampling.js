// The sampling settings a chat request runs with, shown under the model picker.
//
// `GET /v1/models` gives each model's `sampling_defaults`: what a request that sets no sampling
// field gets (the model's generation_config.json over the server's defaults) and which of them the
// model set (`from_model`). The chat sends only the temperature the user typed; an empty field sends
// none, so the model's default applies.

import { h } from "./dom.js";

const SHOWN = [
  ["temperature", "temperature"],
  ["top_p", "top-p"],
  ["top_k", "top-k"],
  ["min_p", "min-p"],
  ["repetition_penalty", "repetition penalty"],
];

/** The temperature typed in `input`: a number in [0, 2], or null (empty or invalid: the default). */
export function chosenTemperature(input) {
  if (input.value.trim() === "") return null;
  const value = Number(input.value);
  return Number.isFinite(value) && value >= 0 && value <= 2 ? value : null;
}

/** The line of effective settings for `defaults` (a model's `sampling_defaults`, or null). */
export function samplingLine(defaults, temperature) {
  if (!defaults) {
    const chosen = temperature === null ? "" : `temperature ${temperature} (yours), `;
    return [`Sampling: ${chosen}the model's defaults (shown on the nodes that hold its files)`];
  }
  const fromModel = new Set(defaults.from_model || []);
  const parts = [];
  for (const [key, label] of SHOWN) {
    if (key === "repetition_penalty" && defaults[key] === 1 && !fromModel.has(key)) continue; // off
    let value = defaults[key];
    let source = fromModel.has(key) ? "model" : "server";
    if (key === "temperature" && temperature !== null) [value, source] = [temperature, "yours"];
    parts.push(h("span.setting", { dataset: { key, source } }, `${label} ${value}`, h("small", {}, ` (${source})`)));
  }
  return ["Sampling: ", ...parts.flatMap((part, i) => (i ? [" · ", part] : [part]))];
}
