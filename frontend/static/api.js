// The server's API as the page uses it: the stored key on every call, errors in OpenAI's shape, and the streamed chat
// completion read as server-sent events from fetch's ReadableStream.

const KEY_STORAGE = "flare.apiKey";

export class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function storeApiKey(key) {
  localStorage.setItem(KEY_STORAGE, key);
}

function headers() {
  const result = { "Content-Type": "application/json" };
  const key = localStorage.getItem(KEY_STORAGE);
  if (key) result.Authorization = `Bearer ${key}`;
  return result;
}

async function httpError(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    message = (await response.json()).error?.message || message;
  } catch {
    // a body that is not JSON: the status line says enough
  }
  return new HttpError(response.status, message);
}

// The served model: its name and whether it takes images (Flare's `capabilities` on the OpenAI model card).
export async function servedModel() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (!response.ok) throw await httpError(response);
  const card = (await response.json()).data[0];
  return { name: card.id, vision: (card.capabilities || []).includes("vision") };
}

// Yields each chunk of a streamed /v1/chat/completions; `signal` aborts it (the server then cancels the request).
export async function* streamChat(body, signal) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST", headers: headers(), body: JSON.stringify(body), signal,
  });
  if (!response.ok) throw await httpError(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replaceAll("\r\n", "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, end).split("\n").filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart()).join("\n");
      buffer = buffer.slice(end + 2);
      if (!data) continue;
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new HttpError(Number(chunk.error.code) || 500, chunk.error.message);
      yield chunk;
    }
  }
}
