"""Loading the policy: the class a model directory needs and its processor (``loading.py``), and the QLoRA 4-bit base
(``qlora.py``, bitsandbytes). The trainer, the HF engine and the debugger all load through here."""

from asyncrl.models.loading import ModelDirError, check_model_dir, is_multimodal, load_causal_lm, load_processor

__all__ = ["ModelDirError", "check_model_dir", "is_multimodal", "load_causal_lm", "load_processor"]
