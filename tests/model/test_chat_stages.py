"""Conversational data through every stage (issue 18): the chat template is applied everywhere, and the
loss sits on the assistant's tokens only.

A Llama-shaped micro model with a Llama-3-style template of its own (``<|start_header_id|>``,
``<|end_header_id|>``, ``<|eot_id|>`` added as special tokens, ``<|eot_id|>`` its eos) goes through
SFT (``messages`` and conversational prompt-completion rows) -> reward model and DPO (explicit and
implicit prompt) -> KTO (unpaired) -> distillation -> GRPO (reward from the reward model) -> evaluation,
and rejection sampling -> RAFT, on conversational data in every TRL format. For each stage the test
reads what the stage reports as the rendered text its model saw (``rendered_examples``, logged as
``samples/rendered_examples.json``) and checks that it holds the template's markers and that the
decoded loss-carrying tokens are the answer and its end-of-turn marker, never prompt or header text.
The micro Qwen2 model, which has no template, runs the same pipeline with ``PLAIN_CHAT_TEMPLATE``.

A few optimizer steps per stage: this checks rendering and masking, not learning.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlhf_core.config import (DistillConfig, DPOConfig, KTOConfig, RejectionConfig, RewardConfig, RLConfig,
                              SFTConfig, TrackingConfig, build_config)
from rlhf_core.data.chat import PLAIN_CHAT_TEMPLATE
from rlhf_core.rollout.evaluate import evaluate_exact_match
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.rollout.rejection import rejection_sample
from rlhf_core.trainers.distill import train_distill
from rlhf_core.trainers.dpo import train_dpo
from rlhf_core.trainers.kto import train_kto
from rlhf_core.trainers.reward import train_reward_model
from rlhf_core.trainers.rl import train_rl
from rlhf_core.trainers.sft import train_sft

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>{{ '\n\n' }}{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{{ '\n\n' }}{% endif %}"
)
SYSTEM = {"role": "system", "content": "Answer exactly."}


@dataclass(frozen=True)
class Template:
    """What a template's rendering looks like: the headers before a user and an assistant turn, and the
    token that ends an assistant turn (the tokenizer's eos)."""

    user_header: str
    assistant_header: str
    end_of_turn: str
    special: tuple[str, ...]
    """The template's special tokens (skipped when an answer is decoded)."""


LLAMA3 = Template("<|start_header_id|>user<|end_header_id|>\n\n", "<|start_header_id|>assistant<|end_header_id|>\n\n",
                  "<|eot_id|>", ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"))
PLAIN = Template("user: ", "assistant: ", "<|endoftext|>", ("<|endoftext|>",))


@pytest.fixture(scope="module")
def llama3_model(tmp_path_factory, micro_tokenizer) -> Path:
    """A micro Llama whose tokenizer has Llama-3 marker tokens and template; eos is ``<|eot_id|>``."""
    from transformers import AutoTokenizer

    from rlhf_core.embedded.tiny_model import build_tiny_model

    tok = AutoTokenizer.from_pretrained(str(micro_tokenizer))
    tok.add_special_tokens({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                            "extra_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"]},
                           replace_extra_special_tokens=False)
    tok_dir = tmp_path_factory.mktemp("tok") / "llama3-tokenizer"
    tok.save_pretrained(str(tok_dir))
    return build_tiny_model(tok_dir, tmp_path_factory.mktemp("models") / "llama3", arch="llama", hidden_size=32,
                            num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=192,
                            seed=0, chat_template=LLAMA3_TEMPLATE)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def conversational_data(micro_data: dict[str, Path], folder: Path) -> dict[str, Path]:
    """The embedded task's rows in every conversational format, a file per form (the gate takes one form
    per file): ``messages`` chats (the first with two assistant turns) and prompt-completion rows for SFT /
    distillation, explicit- and implicit-prompt pairs, unpaired rows, prompts."""
    sft = _rows(micro_data["sft"])[:24]
    prefs = _rows(micro_data["preferences"])[:24]
    first, nxt = sft[0], sft[-1]  # two assistant turns: both carry loss, the user turn between them does not
    chats = [{"messages": [SYSTEM, _user(first["prompt"]), _assistant(first["completion"]),
                           _user(nxt["prompt"]), _assistant(nxt["completion"])]}]
    chats += [{"messages": [_user(r["prompt"]), _assistant(r["completion"])]} for r in sft[1:]]
    completions = [{"prompt": [SYSTEM, _user(r["prompt"])], "completion": [_assistant(r["completion"])]} for r in sft]
    explicit = [{"prompt": [_user(r["prompt"])], "chosen": [_assistant(r["chosen"])],
                 "rejected": [_assistant(r["rejected"])]} for r in prefs]
    implicit = [{"chosen": [_user(r["prompt"]), _assistant(r["chosen"])],
                 "rejected": [_user(r["prompt"]), _assistant(r["rejected"])]} for r in prefs]
    kto_rows = [{"prompt": [_user(r["prompt"])], "completion": [_assistant(r[key])], "desirable": key == "chosen"}
                for r in prefs for key in ("chosen", "rejected")]
    prompt_rows = [{"prompt": [SYSTEM, _user(r["prompt"])], "label": r["label"]}
                   for r in _rows(micro_data["prompts"])[:8]]
    eval_rows = [{"prompt": [_user(r["prompt"])], "label": r["label"]} for r in _rows(micro_data["eval"])[:4]]
    return {"sft": _write(folder / "sft.jsonl", chats), "sft_pc": _write(folder / "sft_pc.jsonl", completions),
            "preferences": _write(folder / "prefs.jsonl", explicit),
            "preferences_implicit": _write(folder / "prefs_implicit.jsonl", implicit),
            "kto": _write(folder / "kto.jsonl", kto_rows), "prompts": _write(folder / "prompts.jsonl", prompt_rows),
            "eval": _write(folder / "eval.jsonl", eval_rows)}


GATE_KINDS = {"sft": "sft", "sft_pc": "sft", "preferences": "preference", "preferences_implicit": "preference",
              "kto": "unpaired", "prompts": "prompts", "eval": "prompts"}
"""The Great Expectations kind each file passes before a stage may read it."""


def check_gate(files: dict[str, Path]) -> None:
    """Every file the pipeline reads passes the data gate (the flows refuse to train on anything else)."""
    from rlhf_core.data.validate import validate_dataset

    for name, path in files.items():
        report = validate_dataset(path, GATE_KINDS[name])
        assert report.success and "conversational" in report.render(), report.render()


# --------------------------------------------------------------------------------------
# What "the model saw the template, and only assistant tokens carry loss" means, per row
# --------------------------------------------------------------------------------------


def check_row(row: dict, tpl: Template, answers: list[str], prompt_texts: list[str]) -> None:
    """``row`` (:func:`rlhf_core.data.sequences.rendered_row`): the rendered text holds the template's user and
    assistant headers; there is one loss span per assistant turn, each the answer then the end-of-turn
    marker, with no header and no prompt text in it."""
    text, spans = row["text"], row["loss_spans"]
    assert tpl.user_header in text and tpl.assistant_header in text, text
    assert len(spans) == len(answers), (spans, answers)
    for span, answer in zip(spans, answers):
        assert span.startswith(answer + tpl.end_of_turn), (span, answer)
        # what may follow the marker is the template's own newline (tokenize_messages' turns)
        assert span[len(answer) + len(tpl.end_of_turn):].strip() == "", span
    loss = "".join(spans)
    assert tpl.user_header.strip() not in loss and tpl.assistant_header.strip() not in loss, loss
    assert not any(p in loss for p in prompt_texts), (loss, prompt_texts)
    assert row["n_loss_tokens"] < row["n_tokens"]


def check_sft_rows(rows: list[dict], tpl: Template, data: Path) -> None:
    """The first rows of an SFT-format file (``messages`` chats, the first with two turns; or prompt-completion)."""
    records = _rows(data)
    assert len(rows) == 4
    for row, rec in zip(rows, records):
        chat = rec["messages"] if "messages" in rec else rec["prompt"] + rec["completion"]
        check_row(row, tpl, [m["content"] for m in chat if m["role"] == "assistant"],
                  [m["content"] for m in chat if m["role"] == "user"])


def check_pair_rows(rows: list[dict], tpl: Template, data: Path, scored: bool = False) -> None:
    records = _rows(data)
    for row, rec in zip(rows, records):
        question = (rec["prompt"] if "prompt" in rec else rec["chosen"][:-1])[-1]["content"]
        for key in ("chosen", "rejected"):
            check_row(row[key], tpl, [rec[key][-1]["content"]], [question])
            if scored:  # the reward model reads its score at the end-of-turn token, as rollouts end
                assert row[key]["scored_token"] == tpl.end_of_turn, row[key]


def check_eval_samples(samples: list[dict], tpl: Template) -> None:
    """Evaluation rendered each prompt with the template; decoded answers hold no special token."""
    assert samples
    for s in samples:
        assert s["prompt"].endswith(tpl.assistant_header) and tpl.user_header in s["prompt"], s
        assert not any(token in s["completion"] for token in tpl.special), s


# --------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------


def _common(model: Path, out: Path, name: str) -> dict:
    return dict(model_path=str(model), output_dir=str(out / name), checkpoint_dir=str(out / f"ckpt-{name}"),
                max_steps=2, batch_size=8, lr=3e-3, warmup_steps=1, max_length=160, num_threads=1)


def run_offline_stages(base: Path, data: dict[str, Path], out: Path, tpl: Template) -> dict[str, Path]:
    """SFT, reward model, DPO, KTO and distillation; each stage's rendered rows checked."""
    sft = train_sft(SFTConfig(**_common(base, out, "sft"), train_file=str(data["sft"]), eval_file=str(data["eval"]),
                              eval_items=4), show_progress=False)
    check_sft_rows(sft.rendered_examples, tpl, data["sft"])
    check_eval_samples(sft.eval_samples, tpl)

    rm = train_reward_model(RewardConfig(**_common(sft.output_dir, out, "rm"), train_file=str(data["preferences"]),
                                         eval_fraction=0.25), show_progress=False)
    check_pair_rows(rm.rendered_examples, tpl, data["preferences"], scored=True)

    dpo = train_dpo(DPOConfig(**_common(sft.output_dir, out, "dpo"), train_file=str(data["preferences_implicit"]),
                              eval_file=str(data["eval"]), eval_items=4), show_progress=False)
    check_pair_rows(dpo.rendered_examples, tpl, data["preferences_implicit"])
    check_eval_samples(dpo.eval_samples, tpl)

    kto = train_kto(KTOConfig(**_common(sft.output_dir, out, "kto"), train_file=str(data["kto"]),
                              eval_file=str(data["eval"]), eval_items=4), show_progress=False)
    for row, rec in zip(kto.rendered_examples, _rows(data["kto"])):
        check_row(row, tpl, [rec["completion"][0]["content"]], [rec["prompt"][0]["content"]])
        assert row["desirable"] == rec["desirable"]

    distill = train_distill(DistillConfig(**_common(sft.output_dir, out, "distill"), teacher_path=str(dpo.output_dir),
                                          train_file=str(data["sft_pc"]), eval_file=str(data["eval"]), eval_items=4),
                            show_progress=False)
    check_sft_rows(distill.rendered_examples, tpl, data["sft_pc"])
    return {"sft": sft.output_dir, "rm": rm.output_dir, "dpo": dpo.output_dir}


def run_grpo_and_evaluate(models: dict[str, Path], data: dict[str, Path], out: Path, tpl: Template) -> None:
    """GRPO from the DPO policy, rewarded by the reward model, then evaluation of its result."""
    cfg = build_config(RLConfig, "rl", {**{**_common(models["dpo"], out, "rl"), "batch_size": 16},
                                        "prompts_file": str(data["prompts"]), "eval_file": str(data["eval"]),
                                        "algorithm.estimator": "grpo", "reward.kind": "model",
                                        "reward.model_path": str(models["rm"]), "rollout.prompts_per_step": 2,
                                        "rollout.group_size": 2, "rollout.max_new_tokens": 6,
                                        "algorithm.mini_batch_size": 4, "eval_items": 4, "eval_at_start": False,
                                        "log_rollouts_every": 1})
    rl = train_rl(cfg, show_progress=False)
    assert rl.rendered_examples
    for row in rl.rendered_examples:
        prompt = row["prompt"]
        assert tpl.user_header in prompt and prompt.endswith(tpl.assistant_header), prompt
        assert row["text"].startswith(prompt)
        # the loss is on exactly what the policy wrote after the rendered prompt
        assert row["loss_spans"] == [row["text"][len(prompt):]], row
    # the reward model (a reward source) was given the rendered prompts
    assert all(tpl.user_header in r["prompt"] for r in rl.rollout_table)
    assert "eval/reward_model_score" in rl.metrics
    check_eval_samples(rl.eval_samples, tpl)

    result = evaluate_exact_match(load_causal_lm(rl.output_dir), load_tokenizer(rl.output_dir), data["eval"],
                                  max_items=4)
    assert result.n == 4
    check_eval_samples(result.samples, tpl)


def run_rejection_and_raft(models: dict[str, Path], data: dict[str, Path], out: Path, tpl: Template) -> None:
    """Best-of-n on conversational prompts writes conversational records; RAFT's SFT renders them."""
    rejection = rejection_sample(RejectionConfig(
        policy_path=str(models["sft"]), prompts_file=str(data["prompts"]), scorer="reward_model",
        reward_model_path=str(models["rm"]), n_samples=4, max_prompts=8, max_new_tokens=6, temperature=1.5,
        output_file=str(out / "best.jsonl"), pairs_file=str(out / "pairs.jsonl"), num_threads=1), show_progress=False)
    kept = _rows(rejection.output_file)
    assert kept, "no sample kept"
    check_gate({"sft_pc": Path(rejection.output_file), "preferences": Path(rejection.pairs_file)})
    for rec in kept:
        assert rec["prompt"][-1]["role"] == "user" and rec["completion"][0]["role"] == "assistant", rec
    for rec in _rows(rejection.pairs_file):
        assert rec["chosen"][0]["role"] == rec["rejected"][0]["role"] == "assistant", rec
    raft = train_sft(SFTConfig(**_common(models["sft"], out, "raft"), train_file=str(rejection.output_file),
                               eval_file=str(data["eval"]), eval_items=4), show_progress=False)
    for row, rec in zip(raft.rendered_examples, kept):
        check_row(row, tpl, [rec["completion"][0]["content"]], [rec["prompt"][-1]["content"]])


@pytest.mark.parametrize("kind", ["llama3", "plain"])
def test_conversational_data_through_every_stage(kind, request, micro_data, tmp_path):
    """Llama-3 template (own marker tokens, eos = ``<|eot_id|>``), or none (``PLAIN_CHAT_TEMPLATE``): every
    stage's rendered text holds the template's markers, and only the assistant's tokens carry loss."""
    base = request.getfixturevalue("llama3_model" if kind == "llama3" else "micro_model")
    tpl = LLAMA3 if kind == "llama3" else PLAIN
    tok = load_tokenizer(base)
    assert tok.eos_token == tpl.end_of_turn
    assert (tok.chat_template == PLAIN_CHAT_TEMPLATE) == (kind == "plain")
    data = conversational_data(micro_data, tmp_path)
    check_gate(data)
    models = run_offline_stages(base, data, tmp_path, tpl)
    run_grpo_and_evaluate(models, data, tmp_path, tpl)
    run_rejection_and_raft(models, data, tmp_path, tpl)


def test_a_stage_logs_its_rendered_examples(isolated_project, micro_model, micro_data):
    """Through the stage and MLflow: ``samples/rendered_examples.json`` is an artifact of the SFT run, and
    a model without a template was trained on the plain template's rendering."""
    import mlflow

    from rlhf_core.stages import wrappers as stages

    data = conversational_data(micro_data, isolated_project)
    chats = _write(isolated_project / "chats.jsonl", [r for r in _rows(data["sft"]) if "messages" in r])
    cfg = SFTConfig(**_common(micro_model, isolated_project, "sft"), train_file=str(chats),
                    eval_file=str(micro_data["eval"]), eval_items=4)
    result = stages.sft(cfg, TrackingConfig(experiment="chat", log_model=False), show_progress=False)
    rows = mlflow.artifacts.load_dict(f"runs:/{result.run_id}/{stages.RENDERED_EXAMPLES}")
    check_sft_rows(rows, PLAIN, chats)
