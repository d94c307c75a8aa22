#!/bin/sh
# Prometheus's entry point in compose.yaml: writes the servers specgate routes to, from the same
# variables specgate reads (SPECGATE_SPECULATIVE_URL, SPECGATE_BASELINE_URL, SPECGATE_ADAPTIVE_URL),
# to a file_sd target file, then runs its arguments (Prometheus and its flags). prometheus.yml's `engines` job reads that
# file and its relabelling splits each URL into scheme, address and metrics path (the URL's path
# + /metrics, where specgate reads it too). POSIX sh and sed only: the Prometheus image is busybox.
#
# Each variable is one base URL or a comma list, each entry optionally NAME=URL, as in
# proxy/fleet/topology.py; a server is named as specgate names it (the `server` label): NAME, else
# its role when the role has one server, else ROLE-i (i counting the role's entries from 0). The
# `backend` label is the role, as the dashboard and the alerts read it.
set -eu
set -f # no globbing of the entries
out=${SERVERS_FILE:-/prometheus/servers.json}

# A JSON string's content: backslashes and double quotes escaped.
json() { printf '%s' "$1" | sed 's/\\/\\\\/g; s/"/\\"/g'; }
# Spaces around an entry or a name go, as topology.py strips them.
trim() { printf '%s' "$1" | sed 's/^[[:space:]]*//; s/[[:space:]]*$//'; }

groups=""
add() { # role, comma list
  role=$1
  count=0
  IFS=,
  for entry in $2; do
    [ -n "$(trim "$entry")" ] && count=$((count + 1))
  done
  i=0
  for entry in $2; do
    entry=$(trim "$entry")
    [ -n "$entry" ] || continue
    name=""
    url=$entry
    case $entry in
      *=*)
        # NAME=URL, where the part before the first `=` is no URL (`://` is not in it).
        case ${entry%%=*} in
          *://*) ;;
          *)
            name=$(trim "${entry%%=*}")
            url=$(trim "${entry#*=}")
            ;;
        esac
        ;;
    esac
    if [ -z "$name" ]; then
      if [ "$count" -eq 1 ]; then name=$role; else name="$role-$i"; fi
    fi
    group="{\"targets\":[\"$(json "$url")\"],\"labels\":{\"backend\":\"$role\",\"server\":\"$(json "$name")\"}}"
    groups="${groups:+$groups,
}$group"
    i=$((i + 1))
  done
  unset IFS
}

add speculative "${SPECGATE_SPECULATIVE_URL:-}"
add baseline "${SPECGATE_BASELINE_URL:-}"
add adaptive "${SPECGATE_ADAPTIVE_URL:-}"
printf '[%s]\n' "$groups" >"$out.tmp"
mv "$out.tmp" "$out"
exec "$@"
