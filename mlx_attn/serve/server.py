"""An OpenAI-compatible HTTP server over the engine (Starlette on uvicorn).

    mlx-attn serve --model model.gguf --host 127.0.0.1 --port 8080

Endpoints: ``POST /v1/chat/completions`` (with tool calling),
``POST /v1/completions`` (server-sent events with ``"stream": true``),
``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (the Anthropic
Messages API), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus text).

Layers, imports pointing one way (down):

- this module: the command (flags, model loading, uvicorn) and ``create_app``;
- :mod:`~mlx_attn.serve.http_app`: the Starlette application, one function
  per endpoint (imported only once an application is built: it needs the
  ``serve`` extra);
- :mod:`~mlx_attn.serve.request_parsing`: JSON bodies -> typed requests;
  :mod:`~mlx_attn.serve.completion` and :mod:`~mlx_attn.serve.event_stream`:
  a request's choices in the engine and its answer, whole or streamed;
  :mod:`~mlx_attn.serve.choice_stream`: one choice's text and logprobs;
- :mod:`~mlx_attn.serve.server_state`: the one worker thread that calls the
  engine and the task that steps it; below it the engine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading

from mlx_attn.serve.server_state import ServerState

__all__ = ["ServerState", "create_app", "make_state", "state_from_args", "build_parser", "check_servable",
           "exposure_warning", "load_embedding_model", "main", "check_draft_flags",
           "load_draft_model"]

API_KEY_ENV = "MLX_ATTN_API_KEY"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
# decode steps of up to this many requests are traced before serving (each new
# row count costs a trace, ~20 ms of CPU here, otherwise paid by a waiting request)
WARM_UP_ROWS = 16


def create_app(state: ServerState, *, api_key: str | None = None, embeddings=None):
    """The Starlette application serving ``state`` (and ``embeddings``, an
    :class:`~mlx_attn.serve.embeddings.EmbeddingModel`, at ``/v1/embeddings``)."""
    from mlx_attn.serve.http_app import build_app

    return build_app(state, api_key, embeddings)


# ---------------------------------------------------------------- the command
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # the mlx-attn command prints one line and exits 2
        raise ValueError(f"{self.prog}: {message}")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from mlx_attn.serve.engine import DEFAULT_PREFILL_GROUP_TOKENS

    parser = _Parser(prog="mlx-attn serve", description="An OpenAI-compatible server (continuous batching over "
                                                        "paged, prefix-sharing K/V).")
    parser.add_argument("--model", default=None, help="a .gguf file, a model directory or a registered name "
                                                      "(default: SmolLM2-135M-Instruct)")
    parser.add_argument("--engine", choices=["auto", "own", "mlx-lm"], default="auto",
                        help="whose model code runs: 'own' (mlx_attn's Llama / Gemma 3, GGUF files), 'mlx-lm' "
                             "(mlx-lm's model classes on the engine's paged attention; needs the mlx-lm extra; "
                             "hybrid models with recurrent layers are served without prefix reuse unless "
                             "--state-snapshots) or 'auto': mlx-lm for a directory whose config.json model_type "
                             "mlx_attn has no model of or whose config its own model refuses (e.g. Llama 3 RoPE "
                             "scaling) and for a Hugging Face repo id (from the local cache), else own")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--max-tokens", type=_positive, default=512,
                        help="max_tokens of a request that gives none")
    parser.add_argument("--temp", type=float, default=0.0, help="temperature of a request that gives none")
    parser.add_argument("--kv-cache-tokens", type=_positive, default=16384,
                        help="the page pool's capacity in tokens, all requests together")
    parser.add_argument("--page-size", type=_positive, default=16, help="tokens per page")
    parser.add_argument("--kv-bits", type=int, choices=[4, 8], default=None, help="quantized K/V pages")
    parser.add_argument("--max-batch-tokens", type=_positive, default=256, help="tokens per engine step")
    parser.add_argument("--prefill-group-tokens", type=_non_negative, default=None,
                        help="prompts that arrive together are prefilled in groups of about this many tokens, "
                             "first come first served, so the first stream a token sooner (docs/serving.md); "
                             f"0: all in one step while --max-batch-tokens lasts (default: "
                             f"{DEFAULT_PREFILL_GROUP_TOKENS} on MLX's CPU device, 0 on a GPU)")
    parser.add_argument("--max-requests", type=_positive, default=256,
                        help="requests served at once (running or waiting for pages); more are answered 429")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer <key>' or 'x-api-key: <key>' (default: "
                             f"${API_KEY_ENV} if set)")
    parser.add_argument("--weights", choices=["auto", "packed", "float32", "as-loaded"], default="auto",
                        help="how the engine holds the weights: auto is packed on MLX's CPU device (integer "
                             "matvecs at every step size, no float32 copy), float32 also "
                             "holds float32 weights for the BLAS (4x the memory), as loaded on a GPU")
    parser.add_argument("--embedding-model", default=None,
                        help="serve POST /v1/embeddings with this sentence encoder: a BERT directory, or "
                             "'all-minilm-l6-v2' (fetched on first use)")
    parser.add_argument("--backend", choices=["auto", "fused", "reference"], default="auto")
    parser.add_argument("--state-snapshots", type=_non_negative, default=0,
                        help="hybrid models (recurrent layers): keep up to this many recurrent states saved at page "
                             "boundaries, so prompts that begin with cached pages reuse them (default 0: no prefix "
                             "reuse for hybrid models)")
    parser.add_argument("--cascade", choices=["on", "off"], default="on",
                        help="cascade attention: running requests that share prefix pages (a system prompt, n > 1 "
                             "choices) read them once per group where that pays (default on; off: every request "
                             "reads its own, for measurement and diagnosis)")
    parser.add_argument("--speculative", choices=["ngram", "draft"], default=None,
                        help="ngram: decoding requests propose tokens that followed their last n-gram earlier in "
                             "their prompt or output; draft: a smaller model with the same tokenizer proposes "
                             "them (--draft-model); either way they are verified in the same step (the same "
                             "outputs, fewer steps)")
    parser.add_argument("--draft-model", default=None, metavar="PATH",
                        help="with --speculative draft: the draft model, loaded as --model is (the same --engine "
                             "and --backend)")
    parser.add_argument("--num-draft-tokens", type=_positive, default=4,
                        help="with --speculative: the most tokens a request proposes per step")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return parser


def make_state(model, tokenizer, model_name: str, *, kv_cache_tokens: int = 16384, page_size: int = 16,
               kv_bits: int | None = None, max_batch_tokens: int = 256, max_tokens: int = 512,
               temperature: float = 0.0, max_requests: int = 256, weights: str = "auto",
               state_snapshots: int = 0, cascade: bool = True, speculative: str | None = None,
               num_draft_tokens: int = 4, prefill_group_tokens: int | None = None,
               draft_model=None) -> ServerState:
    from mlx_attn.serve.engine import Engine, device_prefill_group_tokens

    import mlx.core as mx

    mx.eval(model.parameters())  # loaded here, used on the engine's thread
    if draft_model is not None:
        mx.eval(draft_model.parameters())

    def make_engine():
        engine = Engine(model, kv_tokens=kv_cache_tokens, page_size=page_size, kv_bits=kv_bits,
                        max_batch_tokens=max_batch_tokens, weights=weights, state_snapshots=state_snapshots,
                        cascade=cascade, speculative=speculative, num_draft_tokens=num_draft_tokens,
                        draft_model=draft_model,
                        prefill_group_tokens=device_prefill_group_tokens() if prefill_group_tokens is None
                        else prefill_group_tokens or None)
        engine.warm_up(WARM_UP_ROWS)  # no request waits for a decode step's trace
        return engine

    from mlx_attn.serve.tool_calls import prepare_tokenizer

    prepare_tokenizer(tokenizer)
    return ServerState(make_engine, tokenizer, model_name, default_max_tokens=max_tokens,
                       default_temperature=temperature, max_requests=max_requests)


def check_draft_flags(args: argparse.Namespace) -> None:
    """``--speculative draft`` and ``--draft-model`` go together (a
    ``ValueError`` naming the flag, before any model loads)."""
    from mlx_attn.lm import speculative
    from mlx_attn.lm.validate import FieldError

    try:
        speculative.check_draft_flags(args.speculative, args.draft_model)
    except FieldError as error:
        raise ValueError(f"--draft-model {error.problem}") from None


def load_draft_model(args: argparse.Namespace, model, tokenizer):
    """The ``--draft-model`` (None without), loaded as ``--model`` is; a
    ``ValueError`` naming ``--draft-model`` when its vocabulary or
    tokenizer is not the model's."""
    from mlx_attn.lm.engine_choice import load_for_engine
    from mlx_attn.lm.speculative import check_draft_model, check_draft_tokenizer

    check_draft_flags(args)
    if args.draft_model is None:
        return None
    try:
        draft, draft_tokenizer = load_for_engine(args.draft_model, args.engine, args.backend)
        check_draft_model(model, draft)
        check_draft_tokenizer(tokenizer, draft_tokenizer, args.draft_model)
    except (OSError, ValueError) as error:
        raise ValueError(f"--draft-model {args.draft_model}: {error}") from None
    return draft


def state_from_args(args: argparse.Namespace, model, tokenizer, draft_model=None) -> ServerState:
    """The server's state as the parsed flags of ``mlx-attn serve`` ask."""
    from mlx_attn.lm.model_store import DEFAULT_DECODER

    return make_state(model, tokenizer, args.model or DEFAULT_DECODER, kv_cache_tokens=args.kv_cache_tokens,
                      page_size=args.page_size, kv_bits=args.kv_bits, max_batch_tokens=args.max_batch_tokens,
                      max_tokens=args.max_tokens, temperature=args.temp, max_requests=args.max_requests,
                      weights=args.weights, state_snapshots=args.state_snapshots, cascade=args.cascade == "on",
                      speculative=args.speculative, num_draft_tokens=args.num_draft_tokens,
                      prefill_group_tokens=args.prefill_group_tokens, draft_model=draft_model)


def load_embedding_model(name: str | None, backend: str = "auto"):
    """The ``--embedding-model``: None, a registered encoder's name or a BERT directory."""
    if name is None:
        return None
    from mlx_attn.lm import load_sentence_encoder
    from mlx_attn.lm.model_store import DEFAULT_ENCODER
    from mlx_attn.serve.embeddings import EmbeddingModel

    try:
        encoder = load_sentence_encoder(None if name == DEFAULT_ENCODER else name, backend)
    except (OSError, ValueError) as error:
        raise ValueError(f"--embedding-model {name}: {error}") from None
    return EmbeddingModel(encoder, name)


def check_servable(model) -> None:
    """Refuse, before the server starts, a model the engine cannot page:
    an mlx-lm model with caches other than attention K/V and recurrent
    states (``ValueError`` saying so)."""
    from mlx_attn.lm.mlx_lm_models import MlxLmModel

    if isinstance(model, MlxLmModel):
        from mlx_attn.serve.mlx_lm_paged import check_servable_mlx_lm_model

        check_servable_mlx_lm_model(model)


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """What to print when others than this machine may use the server freely."""
    if host in LOOPBACK or api_key:
        return None
    return (f"mlx-attn serve: warning: listening on {host} without an API key: anyone who can reach this "
            f"address may use the model (set --api-key or ${API_KEY_ENV})")


def main(argv: list[str] | None = None) -> int:
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as error:
        raise RuntimeError(f"mlx-attn serve needs Starlette and uvicorn ({error}): "
                           "pip install 'mlx_attn[serve]'") from None

    from mlx_attn.lm.engine_choice import load_for_engine

    args = build_parser().parse_args(argv)
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    warning = exposure_warning(args.host, api_key)
    if warning:
        print(warning, file=sys.stderr)
    check_draft_flags(args)
    model, tokenizer = load_for_engine(args.model, args.engine, args.backend)
    check_servable(model)
    state = state_from_args(args, model, tokenizer, load_draft_model(args, model, tokenizer))
    app = create_app(state, api_key=api_key, embeddings=load_embedding_model(args.embedding_model, args.backend))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
    _graceful_server_class()(config).run()
    return 0


def _graceful_server_class():
    import signal

    import uvicorn

    class GracefulServer(uvicorn.Server):
        """On SIGTERM or SIGINT: stop accepting, let running requests finish,
        then exit 0 (uvicorn itself re-raises the signal once shut down)."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return GracefulServer
