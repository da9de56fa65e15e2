// Talking to this node: JSON requests with the API key, and a server-sent-events reader.
// The reader is our own (fetch + ReadableStream) rather than EventSource, because EventSource can
// neither send an Authorization header nor POST, and because the chat stream's comment lines
// (`: prefill_progress {...}`) carry data that EventSource throws away.

const KEY = "shoal.apiKey";

export function apiKey() {
  return localStorage.getItem(KEY) || "";
}

export function setApiKey(value) {
  if (value) localStorage.setItem(KEY, value);
  else localStorage.removeItem(KEY);
}

/** Headers for every request: the key, when the user gave one. */
export function headers(extra = {}) {
  const all = { ...extra };
  const key = apiKey();
  if (key) all.Authorization = `Bearer ${key}`;
  return all;
}

export class HttpError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

/** The error message of an OpenAI-shaped error body, else the status line. */
async function failure(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    // not JSON: the status says enough
  }
  const error = body && body.error;
  const message = (error && error.message) || `${response.status} ${response.statusText}`;
  return new HttpError(response.status, message, error && error.code);
}

/** One JSON request; throws `HttpError` for a non-2xx answer. */
export async function call(method, path, body, { signal } = {}) {
  const init = { method, signal, headers: headers(body === undefined ? {} : { "content-type": "application/json" }) };
  if (body !== undefined) init.body = JSON.stringify(body);
  const response = await fetch(path, init);
  if (!response.ok) throw await failure(response);
  return response.status === 204 ? null : response.json();
}

/** POST that answers with a stream: the Response, checked for an error status first. */
export async function openStream(path, body, signal) {
  const response = await fetch(path, {
    method: body === undefined ? "GET" : "POST",
    headers: headers(body === undefined ? { accept: "text/event-stream" } : { "content-type": "application/json" }),
    body: body === undefined ? undefined : JSON.stringify(body),
    signal,
  });
  if (!response.ok) throw await failure(response);
  return response;
}

/**
 * The events of an SSE response, as `{data}` (the joined `data:` lines of one event) or `{comment}`
 * (a `:` line, without the colon). Ends when the body ends; an abort throws AbortError.
 */
export async function* readEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let data = [];
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n")) >= 0) {
        let line = buffer.slice(0, end);
        buffer = buffer.slice(end + 1);
        if (line.endsWith("\r")) line = line.slice(0, -1);
        if (line === "") {
          if (data.length) yield { data: data.join("\n") };
          data = [];
        } else if (line.startsWith(":")) {
          yield { comment: line.slice(1).trimStart() };
        } else {
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          let text = colon < 0 ? "" : line.slice(colon + 1);
          if (text.startsWith(" ")) text = text.slice(1);
          if (field === "data") data.push(text);
        }
      }
    }
    if (data.length) yield { data: data.join("\n") };
  } finally {
    reader.releaseLock();
  }
}
