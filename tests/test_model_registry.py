"""The model registry and the attention hook, from the outside: a toy
architecture defined in this file only (its own tensor names, GGUF keys and
HF model_type, a sliding window on some layers) is registered, written as a
GGUF file and as a Hugging Face directory, loaded by ``load_model``,
converted, and generates the tokens a float64 NumPy forward of the same
weights predicts. Also: Llama goes through the registry, a packed batch of
two sequences runs the model's own forward through a hook of this file, and
the registry's mistakes are clear errors."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_attn import RoPE, scaled_dot_product_attention
from mlx_attn.lm import generate, load_model, stream_generate
from mlx_attn.lm.models.base import AttentionHook, Decoder, LayerAttention, rename_weights
from mlx_attn.lm.models.registry import (Architecture, architecture_for_gguf, architecture_for_hf, architectures,
                                         register)
from mlx_attn.lm.validate import FieldError, require_int
from model_fixtures import llama_gguf_metadata, tiny_hf_tokenizer, write_gguf, write_llama_gguf

ROPE_BASE = 500.0


# ---------------------------------------------------------------- the toy architecture
@dataclasses.dataclass
class ToyConfig:
    vocab_size: int
    width: int
    layers: int
    heads: int
    kv_heads: int
    hidden: int
    window: int  # odd layers see only this many most recent tokens

    def __post_init__(self):
        for field in dataclasses.fields(self):
            setattr(self, field.name, require_int(field.name, getattr(self, field.name), 1, 4096))

    @property
    def head_dim(self) -> int:
        return self.width // self.heads


class ToyBlock(nn.Module):
    def __init__(self, config: ToyConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.heads, config.kv_heads, config.head_dim
        self.attn_norm = nn.RMSNorm(config.width)
        self.wq = nn.Linear(config.width, config.width, bias=False)
        self.wk = nn.Linear(config.width, config.kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.width, config.kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.width, config.width, bias=False)
        self.mlp_norm = nn.RMSNorm(config.width)
        self.up = nn.Linear(config.width, config.hidden, bias=False)
        self.down = nn.Linear(config.hidden, config.width, bias=False)
        self.rope = RoPE(config.head_dim, base=ROPE_BASE)

    def __call__(self, x, positions, layer: LayerAttention, attention: AttentionHook):
        b, t, _ = x.shape
        split = lambda a, n: a.reshape(b, t, n, self.head_dim).transpose(0, 2, 1, 3)
        h = self.attn_norm(x)
        q = self.rope(split(self.wq(h), self.heads), offset=positions)
        k = self.rope(split(self.wk(h), self.kv_heads), offset=positions)
        out = attention(layer, q, k, split(self.wv(h), self.kv_heads))
        x = x + self.wo(out.transpose(0, 2, 1, 3).reshape(b, t, -1))
        return x + self.down(nn.relu(self.up(self.mlp_norm(x))))


class ToyLM(Decoder):
    def __init__(self, config: ToyConfig, backend: str = "auto"):
        super().__init__(backend)
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.width)
        self.blocks = [ToyBlock(config) for _ in range(config.layers)]
        self.norm = nn.RMSNorm(config.width)

    def attention_layers(self):
        c = self.config
        return [LayerAttention(i, c.head_dim**-0.5, window_size=c.window if i % 2 else None, head_dim=c.head_dim)
                for i in range(c.layers)]

    def forward(self, tokens, attention):
        positions = attention.positions(tokens.shape[1])
        x = self.embed(tokens)
        for layer, block in zip(self.attention_layers(), self.blocks):
            x = block(x, positions, layer, attention)
        return self.embed.as_linear(self.norm(x))


GGUF_KEYS = {"width": "toylm.embedding_length", "layers": "toylm.block_count", "heads": "toylm.attention.head_count",
             "kv_heads": "toylm.attention.head_count_kv", "hidden": "toylm.feed_forward_length",
             "window": "toylm.attention.sliding_window"}
GGUF_NAMES = [(r"^tok\.", "embed."), (r"^out_norm\.", "norm."), (r"^blk\.(\d+)\.", r"blocks.\1.")]


def config_from_gguf(metadata: dict) -> ToyConfig:
    values = {}
    for field, key in GGUF_KEYS.items():
        if key not in metadata:
            raise FieldError(key, "is missing")
        values[field] = metadata[key]
    try:
        return ToyConfig(vocab_size=len(metadata["tokenizer.ggml.tokens"]), **values)
    except FieldError as error:
        raise FieldError(GGUF_KEYS.get(error.field, error.field), error.problem) from None


def config_from_hf(config_json: dict) -> ToyConfig:
    fields = {f.name for f in dataclasses.fields(ToyConfig)}
    return ToyConfig(**{k: v for k, v in config_json.items() if k in fields})


def weight_shapes(c: ToyConfig) -> dict:
    kv = c.kv_heads * c.head_dim
    shapes = {"embed.weight": (c.vocab_size, c.width), "norm.weight": (c.width,)}
    for i in range(c.layers):
        for name, shape in (("attn_norm", (c.width,)), ("wq", (c.width, c.width)), ("wk", (kv, c.width)),
                            ("wv", (kv, c.width)), ("wo", (c.width, c.width)), ("mlp_norm", (c.width,)),
                            ("up", (c.hidden, c.width)), ("down", (c.width, c.hidden))):
            shapes[f"blocks.{i}.{name}.weight"] = shape
    return shapes


TOY = register(Architecture(
    name="toylm",
    gguf_architectures=("toylm",),
    hf_model_types=("toylm",),
    model_class=ToyLM,
    config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf,
    sanitize_gguf=lambda weights, config: rename_weights(weights, GGUF_NAMES),
    sanitize_hf=lambda weights, config: {k.removeprefix("model."): v for k, v in weights.items()},
    weight_shapes=weight_shapes,
    hf_config=lambda config: dict(dataclasses.asdict(config), model_type="toylm"),
    layer_count=lambda config: config.layers,
    layers_prefix="blocks",
))

CONFIG = dict(width=32, layers=3, heads=4, kv_heads=2, hidden=48, window=3)


def toy_weights(vocab_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights named as ToyLM's parameters."""
    rng = np.random.default_rng(seed)
    config = ToyConfig(vocab_size=vocab_size, **CONFIG)
    weights = {}
    for name, shape in weight_shapes(config).items():
        weights[name] = (1.0 + 0.1 * rng.standard_normal(shape) if name.endswith("norm.weight")
                         else rng.standard_normal(shape) * (1.0 if name == "embed.weight" else shape[-1] ** -0.5))
    return {k: v.astype(np.float32) for k, v in weights.items()}


def write_toy_gguf(path: Path, weights: dict, **overrides) -> Path:
    tokenizer = {k: v for k, v in llama_gguf_metadata(dict(vocab_size=0, hidden_size=0, intermediate_size=0,
                                                            num_hidden_layers=0, num_attention_heads=0,
                                                            num_key_value_heads=0, rope_theta=1.0)).items()
                 if k.startswith("tokenizer.")}
    metadata = {"general.architecture": "toylm", **{GGUF_KEYS[f]: v for f, v in CONFIG.items()}, **tokenizer}
    metadata.update(overrides)
    to_gguf = {"embed.weight": "tok.weight", "norm.weight": "out_norm.weight"}
    tensors = {to_gguf.get(name, name.replace("blocks.", "blk.")): value for name, value in weights.items()}
    return write_gguf(path, metadata, tensors)


def write_toy_hf(path: Path, weights: dict) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(dict(CONFIG, model_type="toylm", vocab_size=len(
        tiny_hf_tokenizer().get_vocab()))))
    mx.save_safetensors(str(path / "model.safetensors"), {f"model.{k}": mx.array(v) for k, v in weights.items()})
    tiny_hf_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "add_bos_token": False}))
    return path


# ---------------------------------------------------------------- the oracle: float64 NumPy
def numpy_logits(weights: dict, tokens: list[int]) -> np.ndarray:
    """``[T, vocab]`` logits of the toy model, written from its definition."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    c = CONFIG
    d = c["width"] // c["heads"]
    t = len(tokens)

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g

    def rope(x):  # [heads, T, d], split halves
        half = d // 2
        angles = np.arange(t)[:, None] * ROPE_BASE ** (-np.arange(0, d, 2) / d)[None, :]
        cos, sin = np.cos(angles), np.sin(angles)
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    x = w["embed.weight"][tokens]
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    for layer in range(c["layers"]):
        p = f"blocks.{layer}."
        h = rms(x, w[p + "attn_norm.weight"])
        q = rope((h @ w[p + "wq.weight"].T).reshape(t, c["heads"], d).transpose(1, 0, 2))
        k = rope((h @ w[p + "wk.weight"].T).reshape(t, c["kv_heads"], d).transpose(1, 0, 2))
        v = (h @ w[p + "wv.weight"].T).reshape(t, c["kv_heads"], d).transpose(1, 0, 2)
        group = c["heads"] // c["kv_heads"]
        k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
        visible = (j <= i) & ((i - j < c["window"]) if layer % 2 else True)
        scores = np.where(visible, q @ k.transpose(0, 2, 1) / np.sqrt(d), -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + (probs @ v).transpose(1, 0, 2).reshape(t, -1) @ w[p + "wo.weight"].T
        h = rms(x, w[p + "mlp_norm.weight"])
        x = x + np.maximum(h @ w[p + "up.weight"].T, 0) @ w[p + "down.weight"].T
    return rms(x, w["norm.weight"]) @ w["embed.weight"].T


def assert_greedy_matches_numpy(weights, prompt: list[int], generated: list[int]) -> None:
    logits = numpy_logits(weights, prompt + generated[:-1])
    predicted = logits[len(prompt) - 1:].argmax(-1).tolist()
    assert generated == predicted


# ---------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def weights():
    return toy_weights(len(tiny_hf_tokenizer().get_vocab()))


@pytest.mark.parametrize("layout", ["gguf", "hf"])
def test_a_toy_architecture_registered_in_a_test_loads_and_generates(tmp_path, weights, layout):
    path = write_toy_gguf(tmp_path / "toy.gguf", weights) if layout == "gguf" else write_toy_hf(tmp_path / "toy",
                                                                                               weights)
    model, tokenizer = load_model(path)
    assert isinstance(model, ToyLM) and model.config.window == 3
    prompt = tokenizer.encode("the then in the")
    assert len(prompt) > 4  # longer than the window: the windowed layers' caches slide
    # small prefill chunks: the windowed layers' rotating caches see chunks and single tokens
    responses = list(stream_generate(model, tokenizer, prompt, max_tokens=8, stop_at_eos=False, prefill_chunk=2))
    generated = [r.token for r in responses]
    assert len(generated) == 8 and responses[-1].finish_reason == "length"
    assert_greedy_matches_numpy(weights, prompt, generated)
    text = generate(model, tokenizer, prompt, max_tokens=8, stop_at_eos=False)
    assert text == "".join(r.text for r in responses)


def test_the_toy_converts_to_a_directory_that_loads_back(tmp_path, weights):
    from mlx_attn.lm.convert import convert

    out = convert(str(write_toy_gguf(tmp_path / "toy.gguf", weights)), tmp_path / "converted")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "toylm" and config["window"] == 3
    model, tokenizer = load_model(out)
    prompt = tokenizer.encode("in the then")
    generated = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=5, stop_at_eos=False)]
    assert_greedy_matches_numpy(weights, prompt, generated)


def test_the_loader_names_the_toys_own_gguf_key_for_a_wrong_layer_count(tmp_path, weights):
    path = write_toy_gguf(tmp_path / "toy.gguf", weights, **{"toylm.block_count": 5})
    with pytest.raises(ValueError, match="toylm.block_count says a 5-layer model, the checkpoint holds tensors "
                                         "for 3 layers"):
        load_model(path)
    path = write_toy_gguf(tmp_path / "zero.gguf", weights, **{"toylm.attention.head_count": 0})
    with pytest.raises(ValueError, match="GGUF metadata toylm.attention.head_count must be >= 1"):
        load_model(path)


class PackedAttention(AttentionHook):
    """Several sequences packed into one row, one position per token,
    without cache: each token attends causally within its own sequence
    (what a serving engine's hook does, minus the paged store)."""

    def __init__(self, lengths: list[int]):
        self.segment = np.repeat(np.arange(len(lengths)), lengths)
        self.position = np.concatenate([np.arange(n) for n in lengths])

    def positions(self, length):
        return mx.array(self.position, dtype=mx.int32)

    def __call__(self, layer, queries, keys, values):
        same = self.segment[:, None] == self.segment[None, :]
        visible = same & (self.position[None, :] <= self.position[:, None])
        if layer.window_size is not None:
            visible &= self.position[:, None] - self.position[None, :] < layer.window_size
        return scaled_dot_product_attention(queries, keys, values, scale=layer.scale, mask=mx.array(visible))


def test_a_packed_batch_runs_the_models_own_forward_through_a_hook(weights):
    model = ToyLM(ToyConfig(vocab_size=weights["embed.weight"].shape[0], **CONFIG))
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    sequences = [[5, 9, 30, 7, 7, 12], [40, 41, 3]]
    packed = model(mx.array([sequences[0] + sequences[1]]), attention=PackedAttention([6, 3]))
    for sequence, rows in zip(sequences, (packed[0, :6], packed[0, 6:])):
        np.testing.assert_allclose(np.array(rows), numpy_logits(weights, sequence), atol=2e-4, rtol=2e-4)


def test_llama_is_found_through_the_registry():
    from mlx_attn.lm.models.llama import Llama

    assert architecture_for_gguf("llama").model_class is Llama
    assert architecture_for_hf("llama") is architecture_for_hf("mistral") is architecture_for_gguf("llama")
    assert {"llama", "toylm"} <= {arch.name for arch in architectures()}
    with pytest.raises(ValueError, match=r"general.architecture 'gpt2' is not supported \(supported: .*llama"):
        architecture_for_gguf("gpt2")
    with pytest.raises(ValueError, match=r"model_type 'bert' is not supported \(supported: .*mistral"):
        architecture_for_hf("bert")


def test_llama_loads_through_the_registry(tmp_path):
    model, _ = load_model(write_llama_gguf(tmp_path / "tiny.gguf"))
    assert type(model) is architecture_for_gguf("llama").model_class


def test_the_registry_discovers_every_model_module_in_a_fresh_process():
    probe = ("import sys, pkgutil, mlx_attn.lm.models as m\n"
             "from mlx_attn.lm.models.registry import architecture_for_hf\n"
             "architecture_for_hf('llama')\n"
             "print(all(f'mlx_attn.lm.models.{i.name}' in sys.modules for i in pkgutil.iter_modules(m.__path__)))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr


def test_registry_mistakes_are_clear_errors():
    with pytest.raises(ValueError, match="claims gguf_architectures \\['toylm'\\], already those of 'toylm'"):
        register(dataclasses.replace(TOY, name="other", hf_model_types=("other",)))
    with pytest.raises(ValueError, match="hf_model_types must be a tuple"):
        dataclasses.replace(TOY, name="x", hf_model_types="x")
    with pytest.raises(ValueError, match="register takes an Architecture"):
        register("toylm")
    assert register(TOY) is TOY  # registering again (a module imported twice) replaces it


def test_the_hook_argument_is_checked(weights):
    model = ToyLM(ToyConfig(vocab_size=weights["embed.weight"].shape[0], **CONFIG))
    tokens = mx.array([[1, 2, 3]])
    with pytest.raises(ValueError, match="pass cache or attention, not both"):
        model(tokens, cache=model.make_cache(), attention=PackedAttention([3]))
    with pytest.raises(ValueError, match="attention must be an AttentionHook"):
        model(tokens, attention="dense")
    assert [tree_flatten(model.parameters())[0][0]] == ["embed.weight"]


def test_make_cache_gives_each_layer_the_cache_its_rule_needs(weights):
    from mlx_attn.cache import KVCache, RotatingKVCache

    model = ToyLM(ToyConfig(vocab_size=weights["embed.weight"].shape[0], **CONFIG))
    kinds = [(type(c).__name__, getattr(c, "max_size", None), getattr(c, "keep", None)) for c in model.make_cache()]
    assert kinds == [("KVCache", None, None), ("RotatingKVCache", 3, 0), ("KVCache", None, None)]
    kinds = [(type(c).__name__, c.max_size, c.keep) for c in model.make_cache(max_kv_size=8)]
    assert kinds == [("RotatingKVCache", 8, 4), ("RotatingKVCache", 3, 0), ("RotatingKVCache", 8, 4)]
    # a rotating cache that keeps more than the windowed layer may see is refused
    wrong = [KVCache(), RotatingKVCache(8, keep=4), KVCache()]
    with pytest.raises(ValueError, match="layer 1 sees a window of 3 tokens, its RotatingKVCache keeps 8"):
        model(mx.array([[1, 2, 3]]), cache=wrong)


def test_windowed_layers_on_plain_kv_caches_apply_the_window_in_the_attention_call(tmp_path, weights):
    from mlx_attn.cache import KVCache

    model, tokenizer = load_model(write_toy_gguf(tmp_path / "toy.gguf", weights))
    prompt = tokenizer.encode("the then in the")
    cache = [KVCache() for _ in range(CONFIG["layers"])]  # every token kept: the window is the hook's mask
    generated = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=6, stop_at_eos=False,
                                                  prefill_chunk=3, cache=cache)]
    assert_greedy_matches_numpy(weights, prompt, generated)
