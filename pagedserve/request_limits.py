"""Every bound on what one request may make the server do, in one place.

A request is hostile until bounded: each field whose size or shape decides how much
memory, CPU time or engine-thread time the request costs has a limit here, and a
request past it is refused with a 400 that names the field and the limit.  The
server's own flags (--max-request-bytes, --max-n, --max-logprobs, --request-timeout,
--max-waiting-requests, --http-read-timeout) bound the rest; docs/reliability.md lists
them all with their defaults, flags and errors.  These are generous next to what
OpenAI's API allows, and fixed: no legitimate request comes near them.
"""

from __future__ import annotations

# Stop strings are searched in each new piece of text, and the longest is held back
# from streams (OpenAI allows 4).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1000
# A cache salt is hashed into a prompt's first block and kept with the request: a longer
# one separates nothing more (10 MB ones were taken).
MAX_CACHE_SALT_CHARS = 1024
# stop_token_ids and logit_bias entries: walked or applied every step.
MAX_TOKEN_ID_LIST = 1024
# allowed_token_ids: one index per entry every step.
MAX_ALLOWED_TOKEN_IDS = 16384
# bad_words: each is tokenized twice (alone and after a space) once per request, and its
# token sequences are matched against the output every step.
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 200
# Sequences one request may start: prompts (a completions request's list) x n.
MAX_SEQUENCES_PER_REQUEST = 1024
# Inputs one embeddings request may hold (OpenAI's bound; each is one pooled prompt).
MAX_EMBEDDING_INPUTS = 2048
# Tokens summed over one pooling request's prompts (embeddings, score, rerank; OpenAI's
# bound for embeddings): 2,048 inputs of max_model_len tokens each were hours of engine
# time, and every request behind them waited.
MAX_POOLING_REQUEST_TOKENS = 300_000

# A request's own chat template (the server's --chat-template and the model's are
# trusted): template text only, never a path, rendered in a sandboxed child process
# that may use this much time and memory before it is stopped.
MAX_REQUEST_TEMPLATE_CHARS = 64 * 1024
REQUEST_TEMPLATE_SECONDS = 2.0
REQUEST_TEMPLATE_MEMORY_BYTES = 256 << 20
# They render one at a time; a request waits this long for its turn (on the event loop,
# holding no thread), then gets a 503 server_overloaded.
TEMPLATE_QUEUE_SECONDS = 2 * REQUEST_TEMPLATE_SECONDS

# Prompt text is refused before tokenizing when it is longer than max_model_len tokens
# could spell: the longest token of the vocabulary, in characters, times max_model_len
# (no text longer than that can fit), and never more than this many characters.
MAX_PROMPT_CHARS = 32 << 20

# A JSON body's shape, measured on its raw bytes before anything parses it
# (entrypoints/openai/json_body.py): json.loads and pydantic hold the event loop (and the
# GIL) for as long as they take, ~1 s per 500,000 values on 2 cores.  Brackets, braces,
# commas and colons outside strings (about one per value: 50,000 chat messages, or
# 512 prompts of 500 token ids), and levels of nesting.
MAX_JSON_STRUCTURE = 1 << 18
MAX_JSON_DEPTH = 256
# A chunked body's pieces: the HTTP parser (h11, pure Python) costs ~8 us of the event
# loop per piece, and a client sending one-byte chunks held it whole (/health 2 s, a chat
# 6 s, per client).  Past this many pieces, a body whose pieces average fewer bytes than
# the next bound is refused (a 16 MiB body in 4 KiB chunks is 4,096 of them).
MAX_BODY_PIECES = 4096
MIN_BODY_PIECE_BYTES = 256

# Unknown request fields are ignored with a warning, once per name, for this many names.
MAX_WARNED_FIELD_NAMES = 256

# JSON schemas, grammars and regexes for structured outputs and tools, checked before
# the grammar compiler sees them (llguidance recurses on $ref chains and rule chains and
# overflowed its stack, exit 139, at ~2,500 of either; and converting GBNF to Lark is
# Python that holds the GIL, ~1.3 s per MiB).  The libraries refuse deep nesting of
# groups themselves, with an error.
MAX_SCHEMA_CHARS = 1 << 20  # JSON schemas and structural tags (a tag holds every tool's schema)
MAX_GRAMMAR_CHARS = 128 << 10  # grammars, regexes, choices
MAX_SCHEMA_DEPTH = 128  # nesting of subschemas, counting each $ref followed
MAX_SCHEMA_NODES = 100_000  # subschemas visited while measuring that depth
MAX_GRAMMAR_RULES = 1000

# The Responses API's store (--enable-responses-store): the oldest responses go first
# once either bound is reached, so clients cannot grow the server's memory through it.
RESPONSES_STORE_MAX_ENTRIES = 1000
RESPONSES_STORE_MAX_BYTES = 64 << 20

# The most characters (or items) one `*` in a chat template may build: far past any real
# template's use, built in milliseconds; `'a' * 200000000` would take seconds and 200 MB
# before the rendered-size or memory bound could see it.
MAX_TEMPLATE_REPEAT = 1 << 24

# Images (multimodal/image.py): encoded bytes of one image (a data: URL's payload or a
# fetched body), its decoded pixels (checked from the header, before decoding: a
# decompression bomb never allocates), and how long fetching one may take when
# --allowed-media-domains lets the server fetch http(s) URLs.
MAX_IMAGE_BYTES = 20 << 20
MAX_IMAGE_PIXELS = 4096 * 4096
# Either side of an image: a 16,777,216 x 1 PNG is within the pixel bound in 2 KB, and HF's
# Idefics3/SmolVLM processors then spent 2.3 s holding the GIL on resizing it (every
# stream of the process stalled, once per image); 16,384 px stays far past real photos
# and panoramas.
MAX_IMAGE_SIDE = 16384
# Fetching a prompt's http(s) images (--allowed-media-domains), all of them together:
# name lookups, connections and bodies.
IMAGE_FETCH_SECONDS = 10.0
# A JPEG's scans (SOS segments): a progressive file has about ten, and each scan is a pass
# over every pixel, so a 1 MB file of 100,000 empty scans took 84 s to decode (a
# decompression bomb in time that the pixel bound does not see).
MAX_JPEG_SCANS = 100
# Decoded pixels all requests may hold at once, from decoding through the processor:
# one prompt's worth of the largest images.  Each pixel costs ~10-50 bytes until the
# processor is done (the decoded file, its RGB copy, the processor's arrays), so 16
# prompts of 8 such images decoding at once held 11.5 GB; past this bound a prompt waits
# its turn (first come, first served; at most IMAGE_QUEUE_SECONDS, then a 503).  A
# waiting prompt holds one of the server's prepare threads, so at most
# MAX_WAITING_IMAGE_PROMPTS wait (past that: a 503 at once): the other threads stay free
# for every other request's rendering and tokenizing.
MAX_DECODING_PIXELS = 8 * MAX_IMAGE_PIXELS
IMAGE_QUEUE_SECONDS = 10.0
MAX_WAITING_IMAGE_PROMPTS = 4
# A server's torch profile (POST /start_profile) holds every event in memory until it
# stops: it stops itself after this long.
PROFILE_SECONDS = 300.0
