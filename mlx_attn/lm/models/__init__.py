"""Pretrained model architectures, one module each. A decoder module owns
its config (validated on construction), its checkpoint-name mapping
(``sanitize*``), the parameter shapes a config implies and its forward
(through the attention hook of ``base.Decoder``), and registers itself as an
``Architecture`` (``registry``), which finds every module of this package;
reading files is ``mlx_attn.lm.loading``'s job."""

from mlx_attn.lm.models.bert import BertConfig, BertEncoder, SentenceEncoder
from mlx_attn.lm.models.llama import Llama, LlamaConfig

__all__ = ["Llama", "LlamaConfig", "BertConfig", "BertEncoder", "SentenceEncoder"]
