# Sourced by the scripts/repro_*.sh experiments: `resumable_run PRESET OUT NAME FLAGS...` runs
# `experiments.fmnist --preset PRESET` into OUT/NAME (its log in OUT/NAME.log), resuming an interrupted run and
# skipping a finished one (a summary.json not marked interrupted). PYTHON overrides the interpreter (default
# .venv/bin/python).
resumable_run() {
  local preset=$1 out=$2 name=$3; shift 3
  local dir=$out/$name
  [ -f "$dir/summary.json" ] && ! grep -q '"interrupted": {' "$dir/summary.json" && return
  mkdir -p "$out"
  echo "$(date +%T) $name"
  "${PYTHON:-.venv/bin/python}" -m experiments.fmnist --preset "$preset" --no-progress --output-dir "$dir" \
      --resume-or-start "$@" > "$dir.log" 2>&1
}
