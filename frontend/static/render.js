// One message and the conversation list as DOM nodes. Text goes in as text (never as HTML): a reply cannot inject
// markup into the page.

// Fills `into` (a new <article> by default) with `message`; `onRegenerate`, when given, adds the Regenerate button.
export function renderMessage(message, onRegenerate, into = document.createElement("article")) {
  const reasoningOpen = into.querySelector("details")?.open ?? true;
  into.className = `message ${message.role}`;
  into.replaceChildren();
  if (message.images?.length || message.imagesDropped) {
    const images = element("div", "images");
    for (const url of message.images ?? []) {
      const image = document.createElement("img");
      image.src = url;
      image.alt = "attached image";
      images.append(image);
    }
    if (message.imagesDropped) images.append(element("span", "note", `${message.imagesDropped} image(s) not kept`));
    into.append(images);
  }
  if (message.reasoning) {
    const details = element("details", "reasoning");
    details.open = reasoningOpen;
    details.append(element("summary", "", "Reasoning"), element("div", "text", message.reasoning));
    into.append(details);
  }
  const pending = message.role === "assistant" && !message.content && !message.reasoning && !message.finish
    && !message.stopped && !message.error;
  into.append(element("div", pending ? "content pending" : "content", pending ? "…" : message.content));
  if (message.role === "assistant") into.append(footer(message, onRegenerate));
  return into;
}

function footer(message, onRegenerate) {
  const meta = element("div", "meta");
  if (message.error) meta.append(element("span", "error", message.error));
  if (message.stopped) meta.append(element("span", "stopped", "stopped"));
  if (message.finish === "length") meta.append(element("span", "cut", "cut at max tokens"));
  if (message.usage) meta.append(element("span", "usage", usageText(message.usage)));
  if (onRegenerate) {
    const button = element("button", "regenerate", "Regenerate");
    button.type = "button";
    button.addEventListener("click", onRegenerate);
    meta.append(button);
  }
  return meta;
}

export function usageText(usage) {
  const parts = [`${usage.prompt} prompt tokens (${usage.cached} cached)`, `${usage.completion} tokens`];
  if (usage.reasoning) parts.push(`${usage.reasoning} reasoning`);
  if (usage.ttft !== null) parts.push(`TTFT ${usage.ttft.toFixed(2)} s`);
  if (usage.tps !== null) parts.push(`${usage.tps.toFixed(1)} tok/s`);
  return parts.join(" · ");
}

export function renderConversations(list, conversations, onOpen, onDelete) {
  const sorted = [...conversations.list].sort((a, b) => b.updated - a.updated);
  list.replaceChildren(...sorted.map((conversation) => {
    const item = element("li", conversation.id === conversations.current ? "current" : "");
    const open = element("button", "open", conversation.title);
    open.type = "button";
    open.addEventListener("click", () => onOpen(conversation.id));
    const remove = element("button", "delete", "×");
    remove.type = "button";
    remove.setAttribute("aria-label", `Delete ${conversation.title}`);
    remove.addEventListener("click", () => onDelete(conversation.id));
    item.append(open, remove);
    return item;
  }));
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}
