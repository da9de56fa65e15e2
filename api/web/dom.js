// Small DOM and formatting helpers. Everything that comes from the network is set as text, never
// as HTML: hostnames, ids and model names travel through gossip from other machines.

/** `h("span.badge", {title: "x"}, "text", child)`: an element with classes, attributes and children. */
export function h(tag, attrs = {}, ...children) {
  const [name, ...classes] = tag.split(".");
  const el = document.createElement(name || "div");
  if (classes.length) el.className = classes.join(" ");
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "dataset") Object.assign(el.dataset, value);
    else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else if (key === "text") el.textContent = value;
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

/** The last 8 characters of a peer id, as `shoal status` shows it; the full id goes in a title. */
export function shortId(id) {
  return id && id.length > 10 ? `…${id.slice(-8)}` : id || "";
}

/** An id shown short, with the full id in its title (and a data attribute for scripts). */
export function idLabel(id, cls = "node-id") {
  return h(`span.${cls}`, { title: id, dataset: { fullId: id } }, shortId(id));
}

export function bytes(n) {
  if (n === null || n === undefined || !Number.isFinite(n)) return "?";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  let v = n;
  while (v >= 1000 && i < units.length - 1) {
    v /= 1000;
    i += 1;
  }
  return `${v >= 100 || i === 0 ? v.toFixed(0) : v.toFixed(1)} ${units[i]}`;
}

export function seconds(s) {
  if (s === null || s === undefined || !Number.isFinite(s)) return "";
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 90) return `${s.toFixed(1)} s`;
  return `${Math.round(s / 60)} min`;
}

/** Replace `el`'s children only when `key` changed since the last call (keeps hover titles alive). */
export function renderIfChanged(el, key, build) {
  if (el.dataset.renderKey === key) return false;
  el.dataset.renderKey = key;
  el.replaceChildren(...[build()].flat());
  return true;
}
