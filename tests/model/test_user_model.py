"""A user's model goes through the same path: a differently shaped Llama with its own chat template."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import LLAMA_CHAT_TEMPLATE
from rlhf_core.config import SFTConfig
from rlhf_core.data.tokenize import IGNORE_INDEX, tokenize_messages
from rlhf_core.rollout.evaluate import evaluate_exact_match
from rlhf_core.models.loading import ModelLoadError, load_causal_lm, load_tokenizer
from rlhf_core.trainers.sft import train_sft


def test_llama_with_chat_template_loads_and_keeps_its_template(llama_chat_model):
    tok = load_tokenizer(llama_chat_model)
    model = load_causal_lm(llama_chat_model, torch.device("cpu"))
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 3
    assert tok.chat_template == LLAMA_CHAT_TEMPLATE  # its own template, not the plain fallback
    ex = tokenize_messages(tok, [{"role": "user", "content": "2+3="}, {"role": "assistant", "content": "5"}], 64)
    learned = tok.decode([t for t, lab in zip(ex.input_ids, ex.labels) if lab != IGNORE_INDEX])
    assert learned == "5<|im_end|>\n"


def test_sft_on_chat_data_with_user_model(llama_chat_model, micro_data, tmp_path):
    chat = tmp_path / "chat.jsonl"
    rows = [json.loads(line) for line in micro_data["sft"].read_text().splitlines()[:200]]
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": r["prompt"]},
                                                     {"role": "assistant", "content": r["completion"]}]}) + "\n"
                            for r in rows))
    before = {k: v.clone() for k, v in load_causal_lm(llama_chat_model, torch.device("cpu")).state_dict().items()}
    cfg = SFTConfig(model_path=str(llama_chat_model), train_file=str(chat), eval_file=str(micro_data["eval"]),
                    output_dir=str(tmp_path / "out"), max_steps=8, batch_size=16, eval_items=20, warmup_steps=1)
    result = train_sft(cfg, show_progress=False)
    after = load_causal_lm(result.output_dir, torch.device("cpu"))
    assert any(not torch.equal(before[k], v) for k, v in after.state_dict().items())
    res = evaluate_exact_match(after, load_tokenizer(result.output_dir), micro_data["eval"], max_items=20)
    assert res.n == 20


def test_not_a_model_dir_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="not a Hugging Face model directory"):
        load_causal_lm(tmp_path)
    with pytest.raises(ModelLoadError, match="no tokenizer files"):
        load_tokenizer(tmp_path)
