"""Pretrained model architectures built from mlx_attn's attention modules.
Each model module owns its config (validated on construction), its
checkpoint-name mapping (``sanitize*``) and the parameter shapes a config
implies; reading files is ``mlx_attn.lm.loading``'s job."""

from mlx_attn.lm.models.bert import BertConfig, BertEncoder, SentenceEncoder
from mlx_attn.lm.models.llama import Llama, LlamaConfig

__all__ = ["Llama", "LlamaConfig", "BertConfig", "BertEncoder", "SentenceEncoder"]
