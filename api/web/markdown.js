// Model output as Markdown, safely. Two layers: marked (vendor/marked.esm.js) is told to escape every
// piece of raw HTML in the text instead of passing it through, so `<script>` in an answer shows as
// the characters "<script>"; then DOMPurify (vendor/purify.min.js) sanitizes what marked produced
// (it drops `javascript:` links and any attribute or tag not on its allow-list). The page's
// Content-Security-Policy forbids inline scripts besides. Images are shown as their alt text: the
// page fetches nothing that a model names.

import { Marked } from "./vendor/marked.esm.js";

export function escapeHtml(text) {
  return String(text).replace(
    /[&<>"']/g,
    (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c],
  );
}

const marked = new Marked({
  gfm: true,
  breaks: true,
  renderer: {
    html(token) {
      return escapeHtml(token.text);
    },
    image(token) {
      return escapeHtml(token.text || token.href || "");
    },
  },
});

const PURIFY = {
  FORBID_TAGS: ["style", "img", "form", "input", "button", "textarea", "select", "iframe", "svg", "math"],
  FORBID_ATTR: ["style", "class", "id"],
  ALLOW_DATA_ATTR: false,
};

let hooked = false;

function purifier() {
  const purify = window.DOMPurify;
  if (purify && !hooked) {
    purify.addHook("afterSanitizeAttributes", (node) => {
      if (node.tagName === "A") {
        node.setAttribute("target", "_blank");
        node.setAttribute("rel", "noopener noreferrer");
      }
    });
    hooked = true;
  }
  return purify;
}

/** The HTML for `text` as Markdown; without DOMPurify (it failed to load), the text escaped. */
export function renderMarkdown(text) {
  const purify = purifier();
  if (!purify) return `<p>${escapeHtml(text)}</p>`;
  return purify.sanitize(marked.parse(String(text), { async: false }), PURIFY);
}

/** Show `text` in `el` as Markdown. */
export function setMarkdown(el, text) {
  el.innerHTML = renderMarkdown(text);
}
