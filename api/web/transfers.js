// Model files moving to each node (`members[].transfers` of the cluster view): bytes done / total,
// rate and the peers sending while they move; a failed one with its reason (it is retried after a
// backoff); the latest finished ones stay listed, as the node keeps them.

import { bytes, h, idLabel, renderIfChanged } from "./dom.js";

/** Every transfer of the view as {node, host, t}, fetching ones first, then as the nodes list them. */
export function transferRows(view) {
  const rows = view.members.flatMap((m) => (m.transfers || []).map((t) => ({ node: m.id, host: m.host, t })));
  return [...rows.filter((r) => r.t.state === "fetching"), ...rows.filter((r) => r.t.state !== "fetching")];
}

function fraction(t) {
  if (t.state === "done") return 1;
  return t.bytes_total > 0 ? Math.min(1, t.bytes_done / t.bytes_total) : 0;
}

function progress(t) {
  const fill = h("div.bar-fill");
  fill.style.width = `${(fraction(t) * 100).toFixed(1)}%`;
  const total = t.bytes_total > 0 ? bytes(t.bytes_total) : "?";
  return h(
    "div.memory",
    {},
    h("div.bar", { role: "progressbar", "aria-valuemin": 0, "aria-valuemax": 100, "aria-valuenow": Math.round(fraction(t) * 100) }, fill),
    h("span.bar-label.done", {}, `${Math.round(fraction(t) * 100)}% · ${bytes(t.bytes_done)} / ${total}`),
  );
}

function row({ node, host, t }) {
  const source = t.source === "peers" && t.state === "fetching" ? `peers (${t.peers})` : t.source;
  return h(
    "tr",
    { dataset: { node, manifestId: t.manifest_id, state: t.state } },
    h("td", {}, idLabel(node), " ", h("span.muted", {}, host || "?")),
    h("td", { title: t.manifest_id }, t.model || t.manifest_id.slice(0, 12)),
    h("td", {}, source),
    h("td.transfer", {}, progress(t), `files ${t.files_done}/${t.files_total}`),
    h("td.rate", {}, t.state === "fetching" ? `${bytes(t.rate_bps)}/s` : ""),
    h(
      "td",
      {},
      h(`span.badge.state.${t.state === "fetching" ? "loading" : t.state === "done" ? "ready" : "failed"}`, {}, t.state),
      t.error ? h("div.reason", {}, t.error) : null,
    ),
  );
}

/** Show the view's transfers in `table` (its tbody `rows`), hidden when there are none. */
export function renderTransfers(table, rows, view) {
  const found = transferRows(view);
  renderIfChanged(rows, JSON.stringify(found), () => found.map(row));
  table.hidden = found.length === 0;
}
