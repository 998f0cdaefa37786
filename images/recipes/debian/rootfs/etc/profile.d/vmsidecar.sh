# vmsidecar debian guest: the tiny guest's prompt, so console scripts wait for the same "vm# ".
# No bracketed paste: readline would wrap every prompt and command in ESC[?2004h / ESC[?2004l.
case $- in
*i*)
    PS1='vm# '
    [ -n "${BASH_VERSION:-}" ] && bind 'set enable-bracketed-paste off' 2>/dev/null
    ;;
esac
