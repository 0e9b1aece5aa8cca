"""Run by `vllm_adapter.py` in a Python environment with vLLM installed: load an
eqx_tx-exported PEFT adapter with vLLM's own LoRA loader and score tokens with it.

vLLM's loader (`PEFTHelper.from_local_dir`, `validate_legal`,
`LoRAModel.from_local_checkpoint`) reads the directory as vLLM serving would; each
module's `lora_b @ lora_a * scaling`, as vLLM applies it, is then added to the Hugging
Face base model's weight, and that model's log-probs of the tokens are printed as
JSON (vLLM's CUDA kernels cannot run on a CPU; the deltas are what they would add).

    python vllm_adapter_load.py ADAPTER_DIR BASE_DIR TOKENS_JSON
"""

import json
import sys

import torch
import transformers
import vllm.lora.lora_model
from vllm.config.lora import LoRAConfig
from vllm.lora.lora_model import LoRAModel
from vllm.lora.peft_helper import PEFTHelper

# vLLM pins CPU copies of adapters for its GPU workers; this machine has no CUDA driver.
vllm.lora.lora_model.PIN_MEMORY = False

MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def main(adapter: str, base: str, tokens_path: str) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32).eval()
    helper = PEFTHelper.from_local_dir(adapter, max_position_embeddings=model.config.max_position_embeddings)
    helper.validate_legal(LoRAConfig(max_lora_rank=helper.r, max_loras=1))
    lora = LoRAModel.from_local_checkpoint(adapter, MODULES, helper, device="cpu", dtype=torch.float32)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, weights in lora.loras.items():
            delta = weights.lora_b @ weights.lora_a * weights.scaling
            params[name + ".weight"].add_(delta)
        tokens = json.load(open(tokens_path))["tokens"]
        logits = model(torch.tensor([tokens])).logits[0].double()
    logp = torch.log_softmax(logits, -1)[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]
    print(json.dumps({"modules": len(lora.loras), "rank": helper.r, "lora_alpha": helper.lora_alpha,
                      "scaling": sorted({w.scaling for w in lora.loras.values()}), "logprobs": logp.tolist()}))


if __name__ == "__main__":
    main(*sys.argv[1:])
