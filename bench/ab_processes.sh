# A/B between source trees (and environment settings), one side_by_side.py process each, in the order given
# (write them ABBA). Source bench/device_setup.sh first (it puts /tmp/site on PYTHONPATH).
#
#   bash bench/ab_processes.sh OUTDIR PREFIX "SIDE_BY_SIDE ARGS" LABEL=TREE[,VAR=VALUE...][,+--ARG=VALUE...] ...
#
# TREE is a checkout root (`.` for this one; an older commit: `mkdir .abold && git archive REV rlhf_core bench |
# tar -x -C .abold`, carried to the device with `carry: [".devwheels", ".abold"]`). Process i writes
# OUTDIR/PREFIX_i_LABEL.json (one round of the args' rows) and appends its summary line to OUTDIR/PREFIX.log.
# AB_TIMEOUT=SECONDS bounds each process (so a call's time limit cuts one process, not the rest; the first one
# also builds the variant's model and measures the ceiling when --work has none: at 0.5B an SFT process is ~40 s,
# the first ~70 s, so 80 s cut it on 2026-12-02); give every
# process to one invocation: i counts within it, and a second invocation would write over process 1's file.
set -u
out=$1 prefix=$2 args=$3
shift 3
mkdir -p "$out"
i=0
for spec in "$@"; do
  i=$((i + 1))
  label=${spec%%=*} rest=${spec#*=}
  tree=${rest%%,*} envs="" extra=""
  [ "$tree" != "$rest" ] && envs=$(echo "${rest#*,}" | tr ',' ' ')
  for tok in $envs; do  # +--flag=value: an argument of this process alone
    case $tok in +*) extra="$extra ${tok#+}" ;; esac
  done
  envs=$(for tok in $envs; do case $tok in +*) ;; *) printf '%s ' "$tok" ;; esac; done)
  echo "== $i $label tree=$tree env=$envs args=$extra" >> "$out/$prefix.log"  # the tree as given (relative): no host paths
  root=$(cd "$tree" && pwd)
  # shellcheck disable=SC2086  # args and envs are word lists
  timeout "${AB_TIMEOUT:-0}" env $envs PYTHONPATH="/tmp/site:$root" python3 "$root/bench/side_by_side.py" $args $extra --rounds 1 \
    --out "$out/${prefix}_${i}_${label}.json" 2>&1 | grep -E '"row"|Error|error|compile_layers:' | cut -c1-400 >> "$out/$prefix.log"
done
