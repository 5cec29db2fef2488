"""On-policy generation on the tiny target: exactness of batching, multi-turn prompts, stopping,
resume after a kill, refusal of mismatched inputs, and self-synthesis."""

import json

import pytest
import torch

import draftsmith.pipeline.generate as gen_stage
from draftsmith.data.artifacts import read_records
from draftsmith.data.chat import prompt_ids, stop_token_ids, tokenize_conversation
from draftsmith.data.generation import HFGenerator, Sampling, cut_at_stop
from draftsmith.pipeline.config import load_config
from draftsmith.pipeline.errors import StageError
from draftsmith.pipeline.prepare import run_prepare
from tests.tiny import tiny_llama

PROMPTS = [
    "What is the sum of two numbers?",
    "Write a poem about the ocean and the travel of water through a long day.",
    "Hi",
    "Explain why the answer is 42, step by step, with a short story about math.",
    "Plan a day.",
    "Code a function to sum a list.",
]


def _convs(n_turns=2):
    out = []
    for i, p in enumerate(PROMPTS):
        msgs = []
        for t in range(n_turns if i % 2 == 0 else 1):
            msgs += [{"role": "user", "content": f"{p} (turn {t})"}, {"role": "assistant", "content": "old answer"}]
        out.append({"id": f"c{i}", "messages": msgs})
    return out


def _cfg(tmp_path, target, *overrides, name="run"):
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in _convs()))
    return load_config(
        None,
        [
            f"run_dir={tmp_path / name}",
            f"model.target={target}",
            f"data.sources=[{{path: {data}}}]",
            "generate.max_new_tokens=10",
            "generate.batch_size=4",
            "generate.chunk_size=2",
            *overrides,
        ],
    )


def test_cut_at_stop():
    assert cut_at_stop([5, 6, 2, 7], [2]).__dict__ == {"token_ids": [5, 6], "finish_reason": "stop"}
    assert cut_at_stop([5, 6, 7], [2, 3]).__dict__ == {"token_ids": [5, 6, 7], "finish_reason": "length"}


def test_batched_greedy_equals_unbatched_float64(tiny_tok):
    model = tiny_llama(tiny_tok, seed=0, dtype=torch.float64)
    prompts = [prompt_ids(tiny_tok, [{"role": "user", "content": p}]) for p in PROMPTS]
    assert len({len(p) for p in prompts}) > 3  # ragged: left padding is exercised
    stops = stop_token_ids(tiny_tok, model)
    sampling = Sampling(max_new_tokens=24)
    one = HFGenerator(model, tiny_tok.pad_token_id, stops, batch_size=1).generate(prompts, sampling, seed=0)
    four = HFGenerator(model, tiny_tok.pad_token_id, stops, batch_size=4).generate(prompts, sampling, seed=0)
    assert [c.token_ids for c in one] == [c.token_ids for c in four]
    # and both equal a plain token-by-token argmax loop (no cache, no padding)
    for p, c in zip(prompts, one):
        ids = list(p)
        for _ in range(len(c.token_ids)):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert ids[len(p) :] == c.token_ids


def test_multi_turn_model_sees_its_own_answers(tmp_path, tiny_target_dir, tiny_tok, monkeypatch):
    seen = []
    real = HFGenerator.generate

    def spy(self, prompts, sampling, seed):
        out = real(self, prompts, sampling, seed)
        seen.extend(zip([list(p) for p in prompts], [c.token_ids for c in out]))
        return out

    monkeypatch.setattr(HFGenerator, "generate", spy)
    cfg = _cfg(tmp_path, tiny_target_dir)
    run_prepare(cfg)
    manifest, rows = read_records(gen_stage.run_generate(cfg), "generated")
    assert (
        manifest["records"] == len(PROMPTS)
        and manifest["counts"]["finish_length"] + manifest["counts"].get("finish_stop", 0) == 9
    )
    _, eot = tiny_tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    for r in rows:
        answers = [m for m in r["messages"] if m["role"] == "assistant"]
        assert all(m["content"] != "old answer" and m["token_ids"] is not None for m in answers)
        # the record is exactly the chat-template sequence built on the generated ids
        assert r["input_ids"] == tokenize_conversation(tiny_tok, r["messages"]).input_ids
        masked = [t for t, m in zip(r["input_ids"], r["loss_mask"]) if m]
        assert masked == [t for m in answers for t in m["token_ids"] + [eot]]
        if len(answers) == 2:
            # the second prompt starts with the first prompt + the model's own first answer
            first_prompt = prompt_ids(tiny_tok, r["messages"][:1])
            second_prompt = prompt_ids(tiny_tok, r["messages"][:3])
            assert second_prompt[: len(first_prompt) + len(answers[0]["token_ids"]) + 1] == first_prompt + answers[0][
                "token_ids"
            ] + [eot]
            assert (second_prompt, answers[1]["token_ids"]) in seen


def test_stops_on_end_of_turn(tmp_path, tiny_target_dir, tiny_tok):
    # make <|im_end|> the argmax everywhere: every turn must end at once with finish_reason "stop"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    eot = tiny_tok.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        model.lm_head.weight[eot] = model.model.norm.weight.sign() * 50
    biased = tmp_path / "biased"
    model.save_pretrained(biased)
    tiny_tok.save_pretrained(biased)
    cfg = _cfg(tmp_path, biased)
    run_prepare(cfg)
    manifest, rows = read_records(gen_stage.run_generate(cfg), "generated")
    assert manifest["counts"]["finish_stop"] == 9 and "finish_length" not in manifest["counts"]
    for r in rows:
        assert [t for t, m in zip(r["input_ids"], r["loss_mask"]) if m] == [eot] * r["num_supervised"]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_resume_after_kill_gives_the_same_records(tmp_path, tiny_target_dir, monkeypatch, temperature):
    t = f"generate.temperature={temperature}"
    ref_cfg = _cfg(tmp_path / "ref", tiny_target_dir, t)
    run_prepare(ref_cfg)
    _, reference = read_records(gen_stage.run_generate(ref_cfg), "generated")

    cfg = _cfg(tmp_path / "killed", tiny_target_dir, t)
    run_prepare(cfg)
    real_write, calls = gen_stage.write_chunk, []

    def dying_write(*args, **kwargs):
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        calls.append(args[1])
        return real_write(*args, **kwargs)

    monkeypatch.setattr(gen_stage, "write_chunk", dying_write)
    with pytest.raises(KeyboardInterrupt):
        gen_stage.run_generate(cfg)
    out = cfg.run_path / "generated"
    assert not (out / "manifest.json").exists()  # an interrupted run never looks complete
    assert sorted(p.name for p in (out / "chunks").glob("*.json")) == ["chunk-00000.json", "chunk-00001.json"]

    monkeypatch.setattr(gen_stage, "write_chunk", real_write)
    real_answer, resumed_chunks = gen_stage.answer_conversations, []

    def counting_answer(*args, **kwargs):
        resumed_chunks.append(1)
        return real_answer(*args, **kwargs)

    monkeypatch.setattr(gen_stage, "answer_conversations", counting_answer)
    _, resumed = read_records(gen_stage.run_generate(cfg), "generated")
    assert len(resumed_chunks) == 1  # only the unfinished chunk was generated again

    def key(r):
        return r["id"]

    assert sorted(resumed, key=key) == sorted(reference, key=key)


def test_refuses_mismatched_settings_and_targets(tmp_path, tiny_target_dir):
    from tests.tiny import save_tiny_target

    cfg = _cfg(tmp_path, tiny_target_dir)
    run_prepare(cfg)
    gen_stage.run_generate(cfg)
    other = _cfg(tmp_path, tiny_target_dir, "generate.temperature=0.5")
    with pytest.raises(StageError, match=r"generate\.temperature: 0\.0 -> 0\.5"):
        gen_stage.run_generate(other)
    second = save_tiny_target(tmp_path / "other-target", seed=7)
    with pytest.raises(Exception, match="another target"):
        gen_stage.run_generate(_cfg(tmp_path, second))
    with pytest.raises(StageError, match="run `draftsmith prepare`"):
        gen_stage.run_generate(_cfg(tmp_path / "fresh", tiny_target_dir))


def test_dataset_free_bootstrap_by_self_synthesis(tmp_path, tiny_target_dir, tiny_tok):
    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            f"model.target={tiny_target_dir}",
            "generate.synthesize=4",
            "generate.synth.round_size=32",
            "generate.synth.max_new_tokens=12",
            "generate.synth.min_chars=3",
            "generate.max_new_tokens=6",
            "generate.chunk_size=3",
        ],
    )
    manifest, rows = read_records(gen_stage.run_generate(cfg), "generated")
    assert manifest["records"] == 4 and manifest["synthesis"]["accepted"] == 4
    assert manifest["synthesis"]["candidates"] == sum(v for k, v in manifest["synthesis"].items() if k != "candidates")
    prompts = [r["messages"][0]["content"] for r in rows]
    assert len(set(prompts)) == 4 and all(r["domain"] == "synthetic" for r in rows)
    assert all(len(p.strip()) >= 3 and "<|im_end|>" not in p for p in prompts)
    # a second run with the same config is a no-op that finds the complete artifact
    again = gen_stage.run_generate(cfg)
    assert json.loads((again / "manifest.json").read_text())["created"] == manifest["created"]


def test_nothing_to_generate_is_an_error(tmp_path, tiny_target_dir):
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", f"model.target={tiny_target_dir}"])
    with pytest.raises(StageError, match="nothing to generate"):
        gen_stage.run_generate(cfg)


def test_synthesis_openers_start_each_candidate(tmp_path, tiny_tok):
    """Candidate j of a round is the target continuing `openers[j % n]`: the opener is fed to the model after the
    user header (not only pasted onto the text afterwards), and the accepted prompt is opener + continuation."""
    from accelerate import PartialState

    from draftsmith.data.chat import encode_text, user_header
    from draftsmith.data.generation import Completion

    openers = ["Write a Python function that", "Imagine you are"]
    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            "generate.synthesize=5",
            "generate.synth.round_size=4",
            "generate.synth.min_chars=3",
            f"generate.synth.openers={json.dumps(openers)}",
        ],
    )
    seen = []

    class Recorder:
        name = "fake"

        def generate(self, prompts, sampling, seed):
            start = len(seen)
            seen.extend(list(p) for p in prompts)
            return [
                Completion(tiny_tok(f" case {start + j} sorted", add_special_tokens=False)["input_ids"], "stop")
                for j in range(len(prompts))
            ]

    convs, counts = gen_stage.synthesize_prompts(Recorder(), tiny_tok, cfg, tmp_path / "synth", PartialState())
    header = user_header(tiny_tok)
    assert len(seen) == 8  # two rounds of 4 candidates for 5 prompts
    for j, ids in enumerate(seen):
        assert ids == encode_text(tiny_tok, header + openers[j % 2])
    texts = [c["messages"][0]["content"] for c in convs]
    assert len(texts) == 5 and counts["accepted"] == 5
    assert [t.startswith(openers[i % 2]) for i, t in enumerate(texts)] == [True] * 5
    # openers are part of the generate plan: changing them refuses to reuse a finished synthesis
    assert "openers" in cfg.generate.synth.model_dump()
