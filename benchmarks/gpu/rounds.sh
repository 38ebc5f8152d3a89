# Sourced by many_family_teacher.sh and retrofit_variety.sh: latest_round DIR prints the highest r with
# DIR/round<r>/teacher/config.json (0: none), the teacher round a later call continues from.
latest_round() {
  local r=0 d n
  for d in "$1"/round*/teacher/config.json; do
    [ -f "$d" ] || continue
    n=${d#"$1"/round}; n=${n%%/*}
    [ "$n" -gt "$r" ] && r=$n
  done
  echo $r
}
