# Sourced by many_family_teacher.sh and retrofit_variety.sh.
#   latest_round DIR            the highest r with DIR/round<r>/teacher/config.json (0: none), the teacher round a
#                               later call continues from
#   teacher_schedule            the schedule file of the teacher's rounds: SCHEDULE when set ("" for none), else
#                               none for INIT=scratch, GROWN_SCHEDULE with GROW, MF_SCHEDULE otherwise
#   schedule_knob FILE R KEY    KEY's value on round R's line of the schedule FILE (the last line for rounds past
#                               it; nothing when FILE is empty or the line does not set KEY); exit 2, naming the
#                               line, on a malformed schedule or a key outside SCHEDULE_KEYS
# A schedule holds one line per training round, "<r>: KEY=VALUE ...", '#' starting a comment; a value holds no
# spaces (FAMILY_WEIGHTS=vt=0.05,cwe=0.2 lists its pairs with commas).
latest_round() {
  local r=0 d n
  for d in "$1"/round*/teacher/config.json; do
    [ -f "$d" ] || continue
    n=${d#"$1"/round}; n=${n%%/*}
    [ "$n" -gt "$r" ] && r=$n
  done
  echo $r
}

MF_SCHEDULE=benchmarks/gpu/many_family_schedule.txt  # the default schedule of the many-family teacher
GROWN_SCHEDULE=benchmarks/gpu/many_family_grown_schedule.txt  # ... and of a grown one (GROW set)
SCHEDULE_KEYS="TB LENS LR REASONING_WEIGHT LOOKUP_WEIGHT FAMILY_WEIGHTS TRAIN_FAMILIES"
teacher_schedule() {
  if [ "${INIT:-}" = scratch ]; then echo "${SCHEDULE-}"
  elif [ -n "${GROW:-}" ]; then echo "${SCHEDULE-$GROWN_SCHEDULE}"
  else echo "${SCHEDULE-$MF_SCHEDULE}"; fi
}

schedule_knob() {
  [ -n "$1" ] || return 0
  [ -f "$1" ] || { echo "schedule $1: no such file" >&2; return 2; }
  awk -v r="$2" -v k="$3" -v keys="$SCHEDULE_KEYS" '
    { sub(/#.*/, "") } NF == 0 { next }
    $1 !~ /^[0-9]+:$/ {
      printf "%s:%d: a line starts with \"<round>:\", got %s\n", FILENAME, FNR, $1 > "/dev/stderr"; bad = 1; exit 2 }
    { for (i = 2; i <= NF; i++) {
        split($i, kv, "=")
        if ($i !~ /=/ || index(" " keys " ", " " kv[1] " ") == 0) {
          printf "%s:%d: %s is not KEY=VALUE with KEY one of %s\n", FILENAME, FNR, $i, keys > "/dev/stderr"
          bad = 1; exit 2 } }
      n = $1 + 0
      if (n != ++seen) {
        printf "%s:%d: round %d where round %d was due\n", FILENAME, FNR, n, seen > "/dev/stderr"; bad = 1; exit 2 }
      line = $0 }
    n <= r { last = line }
    END { if (bad) exit 2
          if (last == "") last = line
          m = split(last, w, /[ \t]+/)
          for (i = 1; i <= m; i++) if (index(w[i], k "=") == 1) print substr(w[i], length(k) + 2) }
  ' "$1"
}
