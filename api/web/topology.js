// The nodes of the cluster as cards: role, status, host, backend, memory, and the stages each runs.

import { bytes, h, idLabel, renderIfChanged, shortId } from "./dom.js";

/** Which stages of which instance every node runs: node id -> [{instance, model, start, end, layers}]. */
export function stagesByNode(instances) {
  const byNode = new Map();
  for (const instance of instances) {
    const layers = instance.stages.length ? instance.stages[instance.stages.length - 1].end_layer : 0;
    instance.stages.forEach((stage, index) => {
      const list = byNode.get(stage.node_id) || [];
      list.push({
        instance: instance.id,
        model: instance.model,
        index,
        count: instance.stages.length,
        start: stage.start_layer,
        end: stage.end_layer,
        layers,
        tensor: instance.sharding === "tensor",
      });
      byNode.set(stage.node_id, list);
    });
  }
  return byNode;
}

function memoryBar(member) {
  const total = member.memory_total || 0;
  const used = Math.max(0, total - (member.memory_available || 0));
  const fraction = total > 0 ? Math.min(1, used / total) : 0;
  const fill = h("div.bar-fill");
  fill.style.width = `${(fraction * 100).toFixed(1)}%`;
  if (fraction > 0.9) fill.classList.add("high");
  const label = `${bytes(used)} / ${bytes(total)} used`;
  return h(
    "div.memory",
    {},
    h(
      "div.bar",
      {
        role: "meter",
        "aria-label": "memory used",
        "aria-valuemin": 0,
        "aria-valuemax": total,
        "aria-valuenow": used,
        title: `${bytes(member.memory_available)} available`,
      },
      fill,
    ),
    h("span.bar-label", {}, label),
  );
}

/** Layers [start, end) as a person reads them: "layers 0–11 (12 of 24)". */
export function layerRange(start, end, total) {
  if (start === 0 && end === total) return `all ${total} layers`;
  const span = end - start === 1 ? `layer ${start}` : `layers ${start}–${end - 1}`;
  return `${span} (${end - start} of ${total})`;
}

function stageLine(stage) {
  const whole = stage.count === 1;
  const where = stage.tensor ? "a slice of every layer" : layerRange(stage.start, stage.end, stage.layers);
  const part = whole ? "" : ` · ${stage.tensor ? "rank" : "stage"} ${stage.index + 1}/${stage.count}`;
  return h(
    "li",
    { dataset: { instance: stage.instance } },
    h("strong", {}, stage.model),
    ` ${where}${part} `,
    h("span.muted", { title: stage.instance }, `(${stage.instance})`),
  );
}

function lastSeen(member, isSelf) {
  if (isSelf) return "this node";
  if (member.last_seen_s === null || member.last_seen_s === undefined) return "never heard from";
  const s = member.last_seen_s;
  return s < 1.5 ? "seen just now" : `seen ${s < 90 ? `${s.toFixed(0)} s` : `${Math.round(s / 60)} min`} ago`;
}

/** The round trip the node serving this page measured to `member` ("auto" sharding weighs it). */
function roundTrip(member, view) {
  const me = view.members.find((m) => m.id === view.self);
  const us = me && me.round_trips_us ? me.round_trips_us[member.id] : undefined;
  if (us === undefined) return null;
  return us < 1000 ? `${us} µs away` : `${(us / 1000).toFixed(1)} ms away`;
}

function card(member, view, stages) {
  const isSelf = member.id === view.self;
  const trip = roundTrip(member, view);
  const badges = [
    member.role === "leader" ? h("span.badge.leader", { title: `leader of term ${view.term}` }, "leader") : null,
    h(`span.badge.status.${member.status}`, {}, member.status),
  ];
  return h(
    "article.node",
    { dataset: { nodeId: member.id, status: member.status, role: member.role } },
    h("header", {}, idLabel(member.id), h("span.badges", {}, badges)),
    h(
      "div.facts",
      {},
      h("span.host", { title: member.api_url || "" }, member.host || "?"),
      h("span.backend", { title: member.os }, member.backend || "?"),
      h(isSelf ? "span.seen.self" : "span.seen", { title: isSelf ? "the node serving this page" : null }, lastSeen(member, isSelf)),
      trip ? h("span.trip", { title: "TCP round trip from the node serving this page" }, trip) : null,
    ),
    memoryBar(member),
    stages.length
      ? h("ul.stages", {}, stages.map(stageLine))
      : h("p.muted.no-stages", {}, "runs no model"),
  );
}

/** Show `view` (the cluster view) in `container`, one card per member, rebuilt only when it changed. */
export function renderNodes(container, view) {
  const byNode = stagesByNode(view.instances);
  const seen = new Set();
  let previous = null;
  for (const member of view.members) {
    seen.add(member.id);
    let slot = container.querySelector(`:scope > [data-slot="${CSS.escape(member.id)}"]`);
    if (!slot) slot = h("div.slot", { dataset: { slot: member.id } });
    // Only what the card shows goes into the key: `last_seen_s` is rounded as it is shown.
    const stages = byNode.get(member.id) || [];
    const shown = [lastSeen(member, member.id === view.self), roundTrip(member, view)];
    const key = JSON.stringify([{ ...member, last_seen_s: undefined }, view.self, view.term, stages, shown]);
    renderIfChanged(slot, key, () => card(member, view, stages));
    if (previous ? previous.nextSibling !== slot : container.firstChild !== slot) {
      if (previous) previous.after(slot);
      else container.prepend(slot);
    }
    previous = slot;
  }
  for (const slot of [...container.children]) {
    if (!seen.has(slot.dataset.slot)) slot.remove();
  }
}

/** The header line: cluster name, leader and term. */
export function summary(view) {
  const alive = view.members.filter((m) => m.status === "alive").length;
  return h(
    "span",
    {},
    "cluster ",
    h("strong", {}, view.cluster),
    ` · ${alive}/${view.members.length} alive · leader `,
    view.leader ? h("span.node-id", { title: view.leader }, shortId(view.leader)) : "none yet",
    ` · term ${view.term}`,
  );
}
