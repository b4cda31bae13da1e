# Sourced by the background runs here (long_rows.sh, newest_vllm.sh): step NAME PYTHONPATH COMMAND... runs the
# command when NAME is in $STEPS (every step when STEPS is unset), its printout into $O/NAME.txt (its command line
# first) and "start"/"end rc" lines into $O/done, which a later device call reads and brings back.
step() {
  local name=$1 path=$2; shift 2
  local steps=${STEPS:-$name}
  case " ${steps//+/ } " in *" $name "*) ;; *) return ;; esac  # a+b: steps run at once (newest_vllm.sh)
  echo "$(date +%T) start $name" >> "$O/done"
  { echo "command: PYTHONPATH=$path $*"; PYTHONPATH=$path:${PYTHONPATH:-} "$@"; } > "$O/$name.txt" 2>&1
  local rc=$?  # read before the next line's $(date) resets it: every step once read as "rc 0"
  echo "$(date +%T) end $name rc $rc" >> "$O/done"
  rm -rf "${W:?}/$name"
}
