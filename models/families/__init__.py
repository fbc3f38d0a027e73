"""The model families llmflow builds, registered by Hugging Face ``model_type``.

A family is one module here: the config.json keys of its own (``read_options``) and the
decoder layer it assembles from ``models/blocks`` (``build_layer``), both in a ``Family``.
Adding one is writing its module (and any block it needs) and registering it below.
"""

from llmflow.models.config import register_family
from llmflow.models.families.deepseek_v3 import DEEPSEEK_V3, KIMI_K2
from llmflow.models.families.gemma3 import GEMMA3_TEXT
from llmflow.models.families.glm4_moe import GLM4_MOE
from llmflow.models.families.gpt_oss import GPT_OSS
from llmflow.models.families.llama import LLAMA
from llmflow.models.families.mistral import MISTRAL
from llmflow.models.families.mixtral import MIXTRAL
from llmflow.models.families.qwen2 import QWEN2
from llmflow.models.families.qwen2_moe import QWEN2_MOE
from llmflow.models.families.qwen3 import QWEN3
from llmflow.models.families.qwen3_5 import QWEN3_5, QWEN3_5_MOE, QWEN3_5_MOE_TEXT, QWEN3_5_TEXT
from llmflow.models.families.qwen3_moe import QWEN3_MOE
from llmflow.models.families.qwen3_next import QWEN3_NEXT

register_family(LLAMA)
register_family(MISTRAL)
register_family(QWEN2)
register_family(QWEN3)
register_family(QWEN3_MOE)
register_family(QWEN2_MOE)
register_family(MIXTRAL)
register_family(QWEN3_NEXT)
register_family(QWEN3_5_TEXT)
register_family(QWEN3_5)
register_family(QWEN3_5_MOE_TEXT)
register_family(QWEN3_5_MOE)
register_family(DEEPSEEK_V3)
register_family(KIMI_K2)
register_family(GLM4_MOE)
register_family(GEMMA3_TEXT)
register_family(GPT_OSS)
