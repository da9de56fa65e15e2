// The dashboard's entry point: wires the live cluster state to the views, and the API key field.

import { apiKey, setApiKey } from "./api.js";
import { Chat } from "./chat.js";
import { Instances } from "./instances.js";
import { Live } from "./live.js";
import { renderNodes, summary } from "./topology.js";
import { renderTransfers } from "./transfers.js";

const $ = (id) => document.getElementById(id);

function keyField(changed) {
  const input = $("api-key");
  const label = () => ($("key-summary").textContent = apiKey() ? "API key ✓" : "API key");
  input.value = apiKey();
  label();
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    setApiKey(input.value.trim());
    label();
    changed();
    $("key-box").open = false;
  });
}

function main() {
  const instances = new Instances();
  const chat = new Chat();
  let served = null;
  const live = new Live(
    (state) => {
      const view = state.cluster;
      $("summary").replaceChildren(summary(view));
      $("node-count").textContent = `(${view.members.length})`;
      renderNodes($("nodes"), view);
      instances.update(view, state.instance_states);
      renderTransfers($("transfers"), $("transfer-rows"), view);
      const models = view.instances.map((i) => i.model).sort().join();
      if (models !== served) {
        served = models;
        chat.loadModels();
      }
    },
    (mode) => {
      $("live").dataset.mode = mode;
      $("live").textContent = { push: "live", polling: "polling", offline: "offline" }[mode] || mode;
    },
  );
  keyField(() => {
    live.restart();
    instances.loadModels();
    chat.loadModels();
  });
  live.start();
  chat.loadModels();
}

main();
