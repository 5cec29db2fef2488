"""Serve a run's exported drafters in the real engines and check them: for each export directory and each engine
that is installed (vLLM, SGLang), greedy outputs with speculation must equal the engine's own outputs without it,
token for token, and the engine's acceptance counters are printed beside draftsmith's verifier τ on the same
prompts.

    python launch/serve_check.py CONFIG [key=value ...] [--prompts 16] [--max-new-tokens 128] [--out DIR]

Needs a GPU and vLLM and/or SGLang installed (neither is on the CPU machines nor in the GPU check's bundle: their
wheels are larger than a device call may carry). Steps:
1. the run's target is written as a plain HF directory (a GGUF target is converted, since both engines take an HF
   directory most reliably), the prompts are the first `--prompts` eval prompts (the chat-templated token ids eval
   uses, passed to the engines as token ids, so every run sees the same input);
2. draftsmith's own eval on those prompts at T = 0 gives the verifier's τ per drafter (RUN_DIR/serve_check/eval);
3. each (engine, speculation) pair runs in its own subprocess (engines keep GPU memory until their process ends):
   vLLM plain, `eagle3/` and `speculators/` as `method: eagle3`, `dspark/` as `method: dspark` (vLLM's V2 model
   runner); SGLang plain and `eagle3/` as EAGLE3 (skipped when the export wrote it for vLLM only);
4. results go to OUT/serve_check.json and a table on stdout; the exit status is 1 when any greedy output differs.

Acceptance as the engines count it: vLLM's `vllm:spec_decode_num_accepted_tokens` / `num_drafts` counters give
τ = 1 + accepted / drafts; SGLang's `meta_info.spec_accept_length` is completion tokens per verify pass. Both are
comparable with draftsmith's τ (tokens per target pass) at the same chain length.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()


def _engine_runs(export: Path, k: int) -> list[tuple[str, str, dict | None]]:
    """(engine, name, speculation) for every run the export allows, plain decoding first per engine."""
    runs: list[tuple[str, str, dict | None]] = []
    if importlib.util.find_spec("vllm"):
        runs.append(("vllm", "plain", None))
        for name in ("eagle3", "speculators"):
            if (export / name / "config.json").is_file():
                runs.append(
                    ("vllm", name, {"method": "eagle3", "model": str(export / name), "num_speculative_tokens": k})
                )
        if (export / "dspark" / "config.json").is_file():
            block = json.loads((export / "dspark" / "config.json").read_text())["block_size"]
            runs.append(
                (
                    "vllm",
                    "dspark",
                    {"method": "dspark", "model": str(export / "dspark"), "num_speculative_tokens": block},
                )
            )
    if importlib.util.find_spec("sglang"):
        runs.append(("sglang", "plain", None))
        eagle = export / "eagle3" / "config.json"
        if eagle.is_file() and json.loads(eagle.read_text())["architectures"] == ["LlamaForCausalLMEagle3"]:
            runs.append(("sglang", "eagle3", {"path": str(export / "eagle3"), "steps": k}))
    return runs


def _run_one(engine: str, target: str, spec: dict | None, prompts: list[list[int]], max_new: int) -> dict:
    """One engine instance in this process: greedy outputs and the acceptance counters."""
    if engine == "vllm":
        if spec and spec["method"] == "dspark":
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # vLLM 0.33 serves dspark on its V2 model runner only
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=target, speculative_config=spec, seed=0, max_model_len=4096, disable_log_stats=False)
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], SamplingParams(temperature=0.0, max_tokens=max_new)
        )
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        counters = {
            m.name: getattr(m, "value", None) for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")
        }
        drafts = counters.get("vllm:spec_decode_num_drafts") or 0
        accepted = counters.get("vllm:spec_decode_num_accepted_tokens") or 0
        tau = 1 + accepted / drafts if drafts else None
        return {"tokens": tokens, "tau": tau, "counters": counters}
    import sglang as sgl

    kwargs = {}
    if spec:
        kwargs = dict(
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=spec["path"],
            speculative_num_steps=spec["steps"],
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=spec["steps"] + 1,
        )
    llm = sgl.Engine(model_path=target, random_seed=0, **kwargs)
    outs = llm.generate(input_ids=prompts, sampling_params={"temperature": 0.0, "max_new_tokens": max_new})
    llm.shutdown()
    lengths = [o["meta_info"].get("spec_accept_length") for o in outs]
    verify = [o["meta_info"].get("spec_verify_ct") for o in outs]
    tokens = [list(o["output_ids"]) for o in outs]
    tau = sum(len(t) for t in tokens) / sum(verify) if all(verify) else None
    return {"tokens": tokens, "tau": tau, "counters": {"spec_accept_length": lengths, "spec_verify_ct": verify}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None, help="default RUN_DIR/serve_check")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: ENGINE:NAME in a subprocess
    args = ap.parse_args(argv)

    from draftsmith.pipeline.config import load_config

    cfg = load_config(args.config, args.overrides)
    out = args.out or cfg.run_path / "serve_check"
    export = cfg.run_path / "export"
    k = cfg.eval.draft_length
    if args.one:
        job = json.loads((out / "job.json").read_text())
        engine, name = args.one.split(":")
        spec = next(s for e, n, s in _engine_runs(export, k) if (e, n) == (engine, name))
        result = _run_one(engine, job["target"], spec, job["prompts"], args.max_new_tokens)
        (out / f"{engine}-{name}.json").write_text(json.dumps(result))
        return 0

    runs = _engine_runs(export, k)
    if not (export / "manifest.json").is_file():
        print(f"serve_check: no export in {export}; run `draftsmith export` first", file=sys.stderr)
        return 2
    if not runs:
        print(
            "serve_check: neither vLLM nor SGLang is importable here; install one (GPU machines only)", file=sys.stderr
        )
        return 2

    from draftsmith.pipeline.evaluate import eval_prompts, run_eval
    from draftsmith.pipeline.target import load_target

    out.mkdir(parents=True, exist_ok=True)
    target = load_target(cfg.model)
    hf_dir = out / "target-hf"
    if not (hf_dir / "config.json").is_file():
        target.model.save_pretrained(hf_dir)
        target.tokenizer.save_pretrained(hf_dir)
    limit = f"eval.max_prompts={args.prompts}"
    eval_cfg = load_config(
        args.config,
        [
            *args.overrides,
            limit,
            "eval.temperatures=[0.0]",
            f"eval.max_new_tokens={args.max_new_tokens}",
            "eval.output=serve_check/eval",
            "eval.drafters=[none, trained]",
        ],
    )
    prompts = [p["ids"] for p in eval_prompts(eval_cfg, target.tokenizer)][: args.prompts]
    del target
    (out / "job.json").write_text(json.dumps({"target": str(hf_dir), "prompts": prompts}))
    run_eval(eval_cfg)
    ours = json.loads((eval_cfg.run_path / "serve_check" / "eval" / "eval.json").read_text())["runs"][0]["overall"]

    results, failed = {}, False
    for engine, name, _ in runs:
        cmd = [
            sys.executable,
            str(HERE),
            args.config,
            *args.overrides,
            "--one",
            f"{engine}:{name}",
            "--out",
            str(out),
            "--max-new-tokens",
            str(args.max_new_tokens),
        ]
        proc = subprocess.run(cmd)
        path = out / f"{engine}-{name}.json"
        results[f"{engine}:{name}"] = json.loads(path.read_text()) if proc.returncode == 0 and path.is_file() else None
    print(f"{'engine':<8} {'export':<12} {'greedy == plain':<16} {'engine τ':>9} {'draftsmith τ':>13}")
    for engine, name, _ in runs:
        r, plain = results[f"{engine}:{name}"], results.get(f"{engine}:plain")
        if r is None:
            failed = True
            print(f"{engine:<8} {name:<12} {'FAILED TO RUN':<16}")
            continue
        same = plain is not None and r["tokens"] == plain["tokens"]
        failed |= not same
        family = "eagle3" if name in ("eagle3", "speculators") else name
        our_tau = ours.get(family, {}).get("tau") if name != "plain" else 1.0
        engine_tau = f"{r['tau']:.3f}" if r["tau"] else "-"
        print(
            f"{engine:<8} {name:<12} {str(same):<16} {engine_tau:>9} {our_tau if our_tau is None else f'{our_tau:.3f}':>13}"
        )
    (out / "serve_check.json").write_text(json.dumps({"runs": results, "draftsmith": ours}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
