# Sourced by lab_env.sh. The result files name the commit of the tree (kvpop_lab.utils.provenance.git_commit:
# $KVPOP_GIT_COMMIT, else git rev-parse HEAD). A tree whose tracked files differ from HEAD (a copy sent with an older
# git history, or uncommitted edits) would be credited to HEAD: it is named HEAD+changes instead, with a note, unless
# KVPOP_GIT_COMMIT names the commit already. Outside a git repository nothing changes.
if [ -z "${KVPOP_GIT_COMMIT:-}" ] && git rev-parse -q --verify HEAD >/dev/null 2>&1 \
    && ! git diff --quiet HEAD -- 2>/dev/null; then
  export KVPOP_GIT_COMMIT="$(git rev-parse HEAD)+changes"
  echo "note: the tracked files differ from HEAD; results name $KVPOP_GIT_COMMIT (set KVPOP_GIT_COMMIT to the commit" \
       "sent to name it)" >&2
fi
