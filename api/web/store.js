// Conversations kept in the browser's localStorage: they survive a reload, never leave the browser.

const KEY = "shoal.conversations";
const CURRENT = "shoal.currentConversation";

function newId() {
  // crypto.randomUUID exists only in secure contexts, and a node on the LAN is served over plain http.
  return `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 8)}`;
}

export function newConversation(model = "") {
  return { id: newId(), title: "New chat", model, messages: [], updated: Date.now() };
}

export function loadConversations() {
  try {
    const list = JSON.parse(localStorage.getItem(KEY) || "[]");
    return Array.isArray(list) ? list.filter((c) => c && c.id && Array.isArray(c.messages)) : [];
  } catch {
    return [];
  }
}

export function saveConversations(list) {
  try {
    localStorage.setItem(KEY, JSON.stringify(list));
  } catch (error) {
    console.warn("conversations not saved (storage full?):", error.message);
  }
}

export function currentId() {
  return localStorage.getItem(CURRENT);
}

export function setCurrentId(id) {
  localStorage.setItem(CURRENT, id);
}
