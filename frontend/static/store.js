// What the page keeps in the browser's localStorage: the conversations, the one open, and the settings.

const CONVERSATIONS = "flare.conversations.v1";
const SETTINGS = "flare.settings.v1";
const DEFAULT_SETTINGS = { temperature: 0.7, max_tokens: 1024, system: "" };

function read(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback; // storage written by something else: start over rather than fail
  }
}

export function loadSettings() {
  return { ...DEFAULT_SETTINGS, ...read(SETTINGS, {}) };
}

export function saveSettings(settings) {
  localStorage.setItem(SETTINGS, JSON.stringify(settings));
}

export function loadConversations() {
  return read(CONVERSATIONS, { current: null, list: [] });
}

// Images are data: URLs and the storage holds a few MiB: when it is full, older images go first (the text stays).
export function saveConversations(state) {
  for (;;) {
    try {
      localStorage.setItem(CONVERSATIONS, JSON.stringify(state));
      return;
    } catch (error) {
      if (!dropOldestImage(state)) throw error;
    }
  }
}

function dropOldestImage(state) {
  const oldestFirst = [...state.list].sort((a, b) => a.updated - b.updated);
  for (const conversation of oldestFirst) {
    for (const message of conversation.messages) {
      if (message.images?.length) {
        message.images.shift();
        message.imagesDropped = (message.imagesDropped || 0) + 1;
        return true;
      }
    }
  }
  return false;
}

export function newConversation() {
  // crypto.randomUUID exists only in secure contexts; a page reached over plain HTTP on a LAN address is not one.
  const id = `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 10)}`;
  return { id, title: "New chat", messages: [], updated: Date.now() };
}
