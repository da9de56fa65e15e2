// Models and instances: what runs (with its state), what could run (with size and fit), launching
// (the leader's placement preview first, then the real request) and deleting.

import { call } from "./api.js";
import { bytes, h, idLabel, renderIfChanged } from "./dom.js";
import { layerRange } from "./topology.js";

const $ = (id) => document.getElementById(id);

/** What a node holds of an instance: its layers, or (tensor-parallel) its rank's slice of all. */
function rankOrLayers(tensor, stage, index, layers) {
  return tensor ? `rank ${index}, a slice of every layer` : layerRange(stage.start_layer, stage.end_layer, layers);
}

export class Instances {
  constructor() {
    this.view = null;
    this.states = {};
    this.placing = new Map(); // model -> instance id once the leader answered (null before)
    this.deleting = new Set();
    this.models = [];
    $("launch-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const ref = $("launch-ref").value.trim();
      if (ref) this.preview(ref);
    });
    $("refresh-models").addEventListener("click", () => this.loadModels());
  }

  /** A new dashboard state: redraw, and reload the models when the set of instances changed. */
  update(view, states) {
    const before = this.view ? this.view.instances.map((i) => i.id).join() : null;
    this.view = view;
    this.states = states || {};
    const ids = new Set(view.instances.map((i) => i.id));
    for (const [model, id] of this.placing) if (id && ids.has(id)) this.placing.delete(model);
    for (const id of this.deleting) if (!ids.has(id)) this.deleting.delete(id);
    this.render();
    if (before !== view.instances.map((i) => i.id).join()) this.loadModels();
  }

  host(nodeId) {
    const member = this.view && this.view.members.find((m) => m.id === nodeId);
    return member ? member.host : "?";
  }

  render() {
    if (!this.view) return;
    const rows = [];
    for (const [model, id] of this.placing) {
      if (!id || !this.view.instances.some((i) => i.id === id)) rows.push(this.placingRow(model, id));
    }
    for (const instance of this.view.instances) rows.push(this.row(instance));
    const key = JSON.stringify([this.view.instances, this.states, [...this.placing], [...this.deleting]]);
    renderIfChanged($("instance-rows"), key, () => rows);
    $("no-instances").hidden = rows.length > 0;
    $("instances").hidden = rows.length === 0;
    this.renderModels();
  }

  placingRow(model, id) {
    return h(
      "tr",
      { dataset: { model, state: "placing" } },
      h("td", {}, id ? h("span.instance-id", { title: id }, id) : "—"),
      h("td", {}, model),
      h("td.muted", {}, "—"),
      h("td", {}, h("span.badge.state.placing", {}, "placing")),
      h("td"),
    );
  }

  row(instance) {
    const deleting = this.deleting.has(instance.id);
    const status = deleting ? { state: "deleting" } : this.states[instance.id] || { state: "unknown" };
    const layers = instance.stages.length ? instance.stages[instance.stages.length - 1].end_layer : 0;
    const tensor = instance.sharding === "tensor";
    const part = (s, i) => rankOrLayers(tensor, s, i, layers);
    const stages = instance.stages.map((s, i) => h("div.stage", {}, idLabel(s.node_id), ` ${this.host(s.node_id)} · ${part(s, i)}`));
    return h(
      "tr",
      { dataset: { instanceId: instance.id, model: instance.model, state: status.state } },
      h("td", {}, h("span.instance-id", { title: instance.id }, instance.id)),
      h("td", {}, instance.model),
      h("td", {}, stages),
      h(
        "td",
        {},
        h(`span.badge.state.${status.state}`, {}, status.state),
        status.error ? h("div.reason", {}, status.error) : null,
      ),
      h(
        "td",
        {},
        h(
          "button.small.danger",
          { type: "button", disabled: deleting, onclick: () => this.remove(instance) },
          "Delete",
        ),
      ),
    );
  }

  async loadModels() {
    try {
      const answer = await call("GET", "/v1/dashboard/models");
      this.models = answer.data;
    } catch (error) {
      this.models = [];
      this.showError(`models: ${error.message}`);
    }
    this.renderModels();
  }

  renderModels() {
    const running = new Set((this.view ? this.view.instances : []).map((i) => i.model));
    const rows = this.models.map((m) => {
      const fit =
        m.fits === true
          ? h("span.fit.yes", {}, `yes, on ${m.nodes} node${m.nodes === 1 ? "" : "s"}`)
          : m.fits === false
            ? h("span.fit.no", { title: m.reason || "" }, "no")
            : h("span.fit.unknown", { title: m.reason || "" }, "unknown");
      const action = running.has(m.name)
        ? h("span.muted", { title: "an instance of it exists (see Instances)" }, "launched")
        : h(
            "button.small",
            { type: "button", disabled: m.fits === false, onclick: () => this.preview(m.name) },
            "Launch…",
          );
      return h(
        "tr",
        { dataset: { model: m.name } },
        h("td", {}, m.name),
        h("td", {}, m.model_type),
        h("td", {}, bytes(m.size_bytes)),
        h("td", {}, fit, m.fits === false && m.reason ? h("div.reason", {}, m.reason) : null),
        h("td", {}, action),
      );
    });
    renderIfChanged($("model-rows"), JSON.stringify([this.models, [...running]]), () => rows);
    $("no-models").hidden = this.models.length > 0;
    $("models").hidden = this.models.length === 0;
  }

  showError(message) {
    const el = $("launch-error");
    el.textContent = message || "";
    el.hidden = !message;
  }

  /** Ask the leader where `model` would go (spread as the form's sharding says), and show it with a
   * button to go ahead. */
  async preview(model) {
    this.showError("");
    const sharding = $("launch-sharding").value;
    const panel = $("preview");
    panel.hidden = false;
    panel.replaceChildren(h("p.muted", {}, `Asking the leader where ${model} would go…`));
    let plan;
    try {
      const query = `model=${encodeURIComponent(model)}&sharding=${encodeURIComponent(sharding)}`;
      plan = await call("GET", `/v1/instances/preview?${query}`);
    } catch (error) {
      panel.hidden = true;
      this.showError(`${model}: ${error.message}`);
      return;
    }
    const sizes = plan.stage_bytes || [];
    const tensor = plan.sharding === "tensor";
    const layers = plan.stages[plan.stages.length - 1].end_layer;
    const part = (s, i) => rankOrLayers(tensor, s, i, layers);
    const items = plan.stages.map((s, i) =>
      h("li", {}, idLabel(s.node_id), ` ${this.host(s.node_id)}: ${part(s, i)}`, sizes[i] !== undefined ? ` · ${bytes(sizes[i])}` : ""),
    );
    const spread = tensor ? ", tensor-parallel" : "";
    panel.replaceChildren(
      h("h3", {}, `Placement preview: ${plan.model}`),
      h("p.muted", {}, `on ${plan.stages.length} node${plan.stages.length === 1 ? "" : "s"}${spread}, as the leader would place it now`),
      h("ul", {}, items),
      plan.sharding_reason ? h("p.muted", { id: "sharding-reason" }, `Chosen: ${plan.sharding_reason}`) : "",
      h(
        "div.actions",
        {},
        h("button", { type: "button", id: "launch-confirm", onclick: () => this.launch(model, plan.sharding) }, "Launch"),
        h("button.ghost", { type: "button", onclick: () => (panel.hidden = true) }, "Cancel"),
      ),
    );
  }

  async launch(model, sharding = "pipeline") {
    $("preview").hidden = true;
    this.placing.set(model, null);
    this.render();
    try {
      const instance = await call("POST", "/v1/instances", { model, sharding });
      this.placing.set(model, instance.id);
      if ($("launch-ref").value.trim() === model) $("launch-ref").value = "";
    } catch (error) {
      this.placing.delete(model);
      this.showError(`${model}: ${error.message}`);
    }
    this.render();
  }

  async remove(instance) {
    this.deleting.add(instance.id);
    this.render();
    try {
      await call("DELETE", `/v1/instances/${encodeURIComponent(instance.id)}`);
    } catch (error) {
      this.deleting.delete(instance.id);
      this.showError(`delete ${instance.id}: ${error.message}`);
      this.render();
    }
  }
}
