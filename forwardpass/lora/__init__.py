"""LoRA adapters served next to the base model, never merged into it.

``y = W·x + scaling · B(A·x)`` per adapter-targeted projection, with ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` for rslora). Each row of a flattened batch may use a different adapter (or
none): the model runner tells the adapter slots which rows belong to which adapter before every
forward (:meth:`LoRAManager.begin_step`), and each slot adds one low-rank product per adapter present
in the batch over that adapter's rows (see ``manager.py`` for the trade-off).

* ``request.LoRARequest`` — names an adapter directory (vLLM's API).
* ``adapter.load_adapter`` — reads and validates a PEFT directory against a model.
* ``manager.LoRAManager`` — adapter cache, per-batch row mapping, the slots in the projections;
  built by the engine when ``EngineConfig.enable_lora`` (``LLM(model, enable_lora=True)``).
* ``cli`` — ``NAME=PATH`` specs for ``--lora`` (generate, serve).
"""

from forwardpass.lora.request import LoRARequest

__all__ = ["LoRARequest"]
