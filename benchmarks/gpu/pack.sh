# Sourced by the GPU scripts that return their work folder: pack NAME PATTERNS... writes the files PATTERNS match
# (relative to $WORK, expanded there) as $OUT/NAME.tar, split in 15 MiB parts when larger ($OUT returns 8 files).
# Needs WORK, OUT and a stamp function from the sourcing script.
pack() {
  local name=$1; shift
  # shellcheck disable=SC2048,SC2086  # the patterns expand inside WORK
  if ! (cd "$WORK" && shopt -s nullglob && tar -cf - $*) > "$OUT/$name.tar"; then
    rm -f "$OUT/$name.tar"; stamp "pack $name: nothing packed (tar failed)"; return 1
  fi
  if [ "$(stat -c %s "$OUT/$name.tar")" -gt $((15 * 1024 * 1024)) ]; then
    split -b 15m "$OUT/$name.tar" "$OUT/$name.tar.part-" && rm "$OUT/$name.tar"
  fi
  stamp "packed $name ($(find "$OUT" -maxdepth 1 -name "$name.tar*" | wc -l) file(s))"
}
