"""The wire between frontends and the engine: msgspec Structs encoded as MessagePack.

Every struct is `array_like` (positional, compact), `omit_defaults`, and `gc=False` (they hold no
reference cycles). New fields are appended last so that old peers keep decoding.
"""

from __future__ import annotations

import msgspec

PROTOCOL_VERSION = 1


class _Wire(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Resolved sampling settings; the frontend fills in the core's generation defaults."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None  # None: the engine draws one
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    presence_penalty: float = 0.0  # on output tokens, as OpenAI defines it
    frequency_penalty: float = 0.0  # on output tokens
    repetition_penalty: float = 1.0  # on prompt and output tokens, as transformers defines it
    logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token's logprob and the top k
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (echo)
    speculative: bool = True  # False: this request never drafts (docs/speculative.md); its output is the same


class LabelQuery(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A scored prefill reads the logits of `token_ids` at prompt position `position` (docs/design.md, Decisions)."""

    position: int
    token_ids: list[int]


class Constraint(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Structured output: the grammar the output must follow, as the frontend validated it (docs/design.md, Beyond
    plain decoding). kind is an llguidance grammar format: "json_schema", "regex", "choice" (a JSON list of
    strings), "lark" or "gbnf"; text is the schema or grammar itself."""

    kind: str
    text: str


class Hello(_Wire, tag="hello"):
    protocol_version: int
    frontend_id: str


class ImageInput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One prepared image of a prompt (docs/design.md, Images): its placeholder tokens start at `offset`."""

    identity: bytes  # BLAKE2b-256 of the source bytes and the processor settings (common.vision)
    offset: int  # prompt position of its first placeholder token
    grid: list[int]  # (t, h, w) in patches
    patches: bytes  # float32 rows of (3 * temporal * patch * patch), t*h*w of them


class Submit(_Wire, tag="submit"):
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    message_ends: list[int] = []  # token positions where a chat message ends
    arrival: float = 0.0  # time.time() at the frontend
    # A scored prefill (decisions): no token is sampled; the request ends once its prompt is computed, and its
    # Outputs carry the logits of each query's label tokens, in query order.
    label_queries: list[LabelQuery] = []
    constraint: Constraint | None = None  # structured output; None: free text
    images: list[ImageInput] = []  # in prompt order
    cache_salt: str = ""  # requests of different salts never share cached prefixes (common/prefix_history.py)
    # An embedding (docs/design.md, Embeddings): "last" or "mean" pooling of the prompt's final hidden states; like a
    # scored prefill, no token is sampled and the request ends once its prompt is computed. "": not an embedding.
    pooling: str = ""


class Abort(_Wire, tag="abort"):
    request_ids: list[str]


class Goodbye(_Wire, tag="goodbye"):
    """A frontend that shuts down cleanly says so; the engine aborts what it still has of it."""

    frontend_id: str


class ModelCard(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    served_names: list[str]
    checkpoint: str
    architecture: str
    context_limit: int
    eos_token_ids: list[int]
    created: int = 0


class Welcome(_Wire, tag="welcome"):
    engine_id: str
    model: ModelCard
    max_active: int
    queue_capacity: int
    heartbeat_interval: float
    telemetry_address: str = ""  # where the engine publishes Telemetry snapshots (ZMQ PUB)
    cache_identity: bytes = b""  # seeds the engine's prefix keys (common/prefix_history.py), for routing
    page_size: int = 64  # tokens per KV page: the block size of those keys


class Logprobs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Per token: its logprob, and the top-k alternatives (ids and logprobs, best first)."""

    token_ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


class Outputs(_Wire, tag="outputs"):
    """One engine step's news for one frontend, columnar: index i of every list is one request."""

    request_ids: list[str]
    token_ids: list[list[int]]
    finish_reasons: list[str | None]  # "stop" | "length" | "abort" | "error"; None while running
    errors: list[str | None]
    prompt_tokens: list[int]
    cached_tokens: list[int]
    logprobs: list[Logprobs | None] = []  # per request, for its new tokens, when asked for
    prompt_logprobs: list[Logprobs | None] = []  # per request, once, with its first tokens, when asked for
    label_logits: list[list[list[float]]] = []  # per request: per label query, its labels' logits (else [])
    embeddings: list[bytes] = []  # per request: an embedding's pooled vector, little-endian float32, with its finish


class Rejected(_Wire, tag="rejected"):
    request_id: str
    status: int
    message: str
    hint: str = ""


class Heartbeat(_Wire, tag="heartbeat"):
    engine_id: str
    draining: bool = False


class GraphStat(msgspec.Struct, array_like=True, gc=False):
    """Completions of one graph (kind, capacity) over the dashboard's window."""

    kind: str
    capacity: int
    calls: int
    mean_ms: float
    max_ms: float
    requests_per_call: float
    width: int = 0  # a verify graph's target positions per request (capacity is then its batch capacity)


class RequestRow(msgspec.Struct, array_like=True, gc=False):
    slot: int
    generation: int
    phase: str
    gap_ms: float  # since the request last committed a token (or arrived)
    prompt_done: int
    prompt_len: int
    outputs: int
    since_publish_ms: float  # -1 before the first publication
    bursts: int
    speculative_rounds: int = 0  # completed verify rounds (each publication of one counts as one burst)


class Telemetry(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="telemetry"):
    """The engine's state, published on its telemetry socket twice a second. Counters only grow."""

    engine_id: str
    uptime_s: float
    counters: dict[str, int]
    gauges: dict[str, float]
    queue_time_buckets: list[int]  # cumulative counts at QUEUE_TIME_BUCKETS, then +Inf
    queue_time_sum: float
    graphs: list[GraphStat] = []  # only while a dashboard is attached
    requests: list[RequestRow] = []  # only while a dashboard is attached
    dropped_updates: int = 0


TELEMETRY_METRICS_TOPIC = b"m"  # snapshots for /metrics
TELEMETRY_CACHE_TOPIC = b"c"  # CacheEvents: the block keys the engine's prefix cache gains and loses
TELEMETRY_DASHBOARD_TOPIC = b"d"  # the same with graph and request detail, recorded only while subscribed
# The kinds of engine step, each counted in a Telemetry snapshot as launches_<kind>, step_microseconds_<kind> (the
# steps' summed durations: GPU time where the graph executor's events measure it) and step_tokens_<kind>.
STEP_KINDS = ("decode", "prefill", "mixed", "verify")
QUEUE_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

FrontendMessage = Hello | Submit | Abort | Goodbye
EngineMessage = Welcome | Outputs | Rejected | Heartbeat

_encoder = msgspec.msgpack.Encoder()
_frontend_decoder = msgspec.msgpack.Decoder(FrontendMessage)
_engine_decoder = msgspec.msgpack.Decoder(EngineMessage)


def encode(message: FrontendMessage | EngineMessage) -> bytes:
    return _encoder.encode(message)


def decode_frontend_message(data: bytes) -> FrontendMessage:
    return _frontend_decoder.decode(data)


def decode_engine_message(data: bytes) -> EngineMessage:
    return _engine_decoder.decode(data)


_telemetry_decoder = msgspec.msgpack.Decoder(Telemetry)


def decode_telemetry(data: bytes) -> Telemetry:
    return _telemetry_decoder.decode(data)


class CacheEvents(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What an engine's prefix cache gained and lost since its last announcement, as block keys (complete 64-token
    blocks only). `full`: `stored` and `hosted` are everything it holds, sent when a subscriber arrives; they replace
    what was known. `hosted`: keys that left the device for the host tier, still cached (a restore away)."""

    engine_id: str
    stored: list[bytes] = []
    evicted: list[bytes] = []
    full: bool = False
    hosted: list[bytes] = []


_cache_events_decoder = msgspec.msgpack.Decoder(CacheEvents)


def decode_cache_events(data: bytes) -> CacheEvents:
    return _cache_events_decoder.decode(data)


def telemetry_address(listen: str) -> str:
    """The engine's telemetry socket sits beside its request socket: the next TCP port, or a sibling ipc path."""
    if listen.startswith("tcp://"):
        host, port = listen[len("tcp://"):].rsplit(":", 1)
        return f"tcp://{host}:{int(port) + 1}"
    return listen + ".telemetry"
