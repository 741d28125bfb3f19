#!/usr/bin/env bash
# Test hosts made of network namespaces, and the faults between them (docs/faults.md).
#
#   fault-hosts.sh up --prefix P --hosts N|NAME,NAME,... [--subnet 10.77.K] [--rate 8mbit]
#                     [--owner PID]
#   fault-hosts.sh down --prefix P            (or: down P)
#   fault-hosts.sh exec P HOST COMMAND...     run COMMAND on HOST (ip netns exec)
#   fault-hosts.sh addr P HOST                HOST's address;   ns P HOST: its namespace
#   fault-hosts.sh hosts P                    one line per host: NAME NAMESPACE ADDRESS
#   fault-hosts.sh partition P A B            drop everything between A and B, both ways
#   fault-hosts.sh isolate P A [--except B,C] partition A from every other host (but B, C)
#   fault-hosts.sh heal P [A [B]]             undo partitions: all, A's, or A<->B
#   fault-hosts.sh impair P [--delay 20ms] [--loss 5%] [--jitter 0ms] [--hosts A,B]
#                           [--via auto|netem|nfqueue] [--seed S]
#   fault-hosts.sh unimpair P                 every link clean again
#   fault-hosts.sh faults P                   the partitions and impairments in force
#   fault-hosts.sh list                       every set of hosts, with its owner
#   fault-hosts.sh gc                         remove the sets whose owner process is gone
#   fault-hosts.sh check                      can this machine do it (root, ip netns, iptables,
#                                             netem or shard-net-impair)? exit 0 if partitions work
#
# `up` makes a "switch" namespace P.sw holding a bridge, and one namespace P.NAME per host (hosts
# h1..hN for a number, or the names given), each with an interface eth0 on the bridge and an
# address 10.77.K.(10+i)/24 (i = 1, 2, ... in the order given). Nothing changes in the root
# namespace: the hosts reach only one another, so two sets never clash, whatever their subnets
# (K defaults to one derived from the prefix, so that logs of parallel runs differ). `--rate`
# gives every host's link that speed (a tbf qdisc on its eth0): a job's steps then take as long
# on a fast machine as on a slow one, so that a test's faults land while it trains. Every
# command fails with a message if P is not up. `down` kills every process still running in the
# set's namespaces (by pid: `ip netns pids`), deletes the namespaces and forgets the set; it is
# safe to run at any time, twice, or on a half-built set. `up --owner PID` records the process
# the set belongs to (default: the caller of this script); `gc` removes sets whose owner died
# without `down` (a test runner killed by SIGKILL).
#
# Partitions are iptables DROP rules in a chain SHARD-FAULTS of each host's own namespace, hooked
# into INPUT and OUTPUT: silent loss, as a pulled cable or a firewall rule, not a refused
# connection. Loss and delay use `tc qdisc netem` on each host's eth0 where the kernel has it;
# otherwise (CONFIG_NET_SCH_NETEM unset) an NFQUEUE rule in each impaired host's OUTPUT hands its
# outgoing packets to shard-net-impair (tests/faults/net_impair.cc, built into build/bin), which
# gives them back after the delay and drops the fraction asked for. Either way each host delays
# what it sends: 20 ms on every host makes a 40 ms round trip.
#
# Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN), iproute2 and iptables (scripts/setup.sh).
# State lives in ${SHARD_FAULT_HOSTS_STATE:-/run/shard-fault-hosts}/P.
set -euo pipefail
shopt -s inherit_errexit  # a failure inside $(...) stops it too

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="${SHARD_FAULT_HOSTS_STATE:-/run/shard-fault-hosts}"
IPTABLES="${SHARD_IPTABLES:-iptables}"
FAULT_CHAIN=SHARD-FAULTS
IMPAIR_CHAIN=SHARD-IMPAIR
IMPAIR_QUEUE=0

die() { echo "fault-hosts: $*" >&2; exit 1; }
usage_error() { echo "fault-hosts: $* (see --help)" >&2; exit 2; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

valid_prefix() { [[ "$1" =~ ^[a-z0-9][a-z0-9-]{0,23}$ ]]; }
valid_host() { [[ "$1" =~ ^[a-z][a-z0-9]{0,11}$ ]]; }

# The set's directory; fails unless it is up.
set_dir() {
  valid_prefix "$1" || usage_error "not a prefix: '$1' ([a-z0-9-], at most 24 characters)"
  [ -f "$STATE/$1/hosts" ] || die "no hosts with prefix '$1' are up (fault-hosts.sh up --prefix $1 --hosts N)"
  echo "$STATE/$1"
}

# NAME NAMESPACE ADDRESS of HOST, from the set's hosts file.
host_line() {
  local dir line
  dir="$(set_dir "$1")"
  line="$(awk -v h="$2" '$1 == h' "$dir/hosts")"
  [ -n "$line" ] || die "no host '$2' in $1 (hosts: $(awk '{printf "%s ", $1}' "$dir/hosts"))"
  echo "$line"
}
host_ns() { host_line "$1" "$2" | awk '{print $2}'; }
host_addr() { host_line "$1" "$2" | awk '{print $3}'; }
host_names() { awk '{print $1}' "$(set_dir "$1")/hosts"; }

in_ns() { local ns="$1"; shift; ip netns exec "$ns" "$@"; }

# The start time of a process (field 22 of /proc/PID/stat), to tell it from a later one with the
# same pid.
start_time() { awk '{sub(/^.*\) /, ""); print $20}' "/proc/$1/stat" 2>/dev/null || true; }

# Whether PID runs (a zombie does not: a delayer this script started is reaped by init, whenever
# init gets to it).
running() {
  local state
  state="$(awk '{sub(/^.*\) /, ""); print $1}' "/proc/$1/stat" 2>/dev/null || true)"
  [ -n "$state" ] && [ "$state" != Z ]
}

owner_alive() {
  local pid started
  read -r pid started < "$1/owner" 2>/dev/null || return 0  # no owner recorded: keep it
  [ -n "$pid" ] || return 0
  running "$pid" || return 1
  [ "$(start_time "$pid")" = "$started" ]
}

# The link speed of a host: a token bucket on what it sends (burst: a few packets).
set_rate() {
  tc -n "$1" qdisc replace dev eth0 root tbf rate "$2" burst 16kb latency 100ms
}

# -- up / down -------------------------------------------------------------------------------------

cmd_up() {
  local prefix="" hosts="" subnet="" owner="$PPID" rate=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --prefix) prefix="$2"; shift 2 ;;
      --rate) rate="$2"; shift 2 ;;
      --hosts) hosts="$2"; shift 2 ;;
      --subnet) subnet="$2"; shift 2 ;;
      --owner) owner="$2"; shift 2 ;;
      *) usage_error "up: unknown argument '$1'" ;;
    esac
  done
  valid_prefix "$prefix" || usage_error "up needs --prefix P ([a-z0-9-], at most 24 characters)"
  [ -n "$hosts" ] || usage_error "up needs --hosts N or --hosts NAME,NAME,..."
  local names=()
  if [[ "$hosts" =~ ^[0-9]+$ ]]; then
    if [ "$hosts" -lt 1 ] || [ "$hosts" -gt 200 ]; then usage_error "--hosts N takes 1..200"; fi
    for ((i = 1; i <= hosts; i++)); do names+=("h$i"); done
  else
    IFS=, read -r -a names <<< "$hosts"
    for name in "${names[@]}"; do
      valid_host "$name" || usage_error "not a host name: '$name' ([a-z][a-z0-9], at most 12)"
      [ "$name" != sw ] || usage_error "'sw' is the switch's name, not a host's"
    done
    [ "$(printf '%s\n' "${names[@]}" | sort | uniq -d)" = "" ] || usage_error "host names repeat"
    [ "${#names[@]}" -le 200 ] || usage_error "at most 200 hosts"
  fi
  if [ -z "$subnet" ]; then
    # Cosmetic: the sets are isolated from one another whatever their addresses.
    subnet="10.77.$(( $(printf '%s' "$prefix" | cksum | cut -d' ' -f1) % 200 + 20 ))"
  fi
  [[ "$subnet" =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || usage_error "--subnet takes A.B.C (a /24)"
  [ -z "$rate" ] || [[ "$rate" =~ ^[0-9]+(\.[0-9]+)?(kbit|mbit|gbit)$ ]] || usage_error "--rate takes e.g. 8mbit"
  [ "$(id -u)" -eq 0 ] || die "up needs root (network namespaces, iptables)"
  command -v ip >/dev/null || die "ip (iproute2) is missing: scripts/setup.sh installs it"
  command -v "$IPTABLES" >/dev/null || die "$IPTABLES is missing: scripts/setup.sh installs iptables"

  local dir="$STATE/$prefix"
  if [ -e "$dir" ] || ip netns list | awk '{print $1}' | grep -qx "$prefix\.sw"; then
    die "prefix '$prefix' is in use (fault-hosts.sh down --prefix $prefix, or gc)"
  fi
  mkdir -p "$dir"
  echo "$owner $(start_time "$owner")" > "$dir/owner"
  echo "$subnet" > "$dir/subnet"
  echo "$rate" > "$dir/rate"
  : > "$dir/hosts.partial"
  # Whatever fails from here on, nothing is left behind.
  trap 'echo "fault-hosts: up failed; removing what was made" >&2; cmd_down "$prefix" >/dev/null 2>&1 || true' ERR

  local sw="$prefix.sw"
  echo "$prefix.sw" >> "$dir/namespaces"
  ip netns add "$sw"
  ip -n "$sw" link set lo up
  ip -n "$sw" link add br0 type bridge
  ip -n "$sw" link set br0 up
  local i=0 name ns address
  for name in "${names[@]}"; do
    i=$((i + 1))
    ns="$prefix.$name"
    address="$subnet.$((10 + i))"
    echo "$ns" >> "$dir/namespaces"
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip -n "$sw" link add "p-$name" type veth peer name eth0 netns "$ns"
    ip -n "$sw" link set "p-$name" master br0
    ip -n "$sw" link set "p-$name" up
    ip -n "$ns" addr add "$address/24" dev eth0
    ip -n "$ns" link set eth0 up
    [ -z "$rate" ] || set_rate "$ns" "$rate"
    # The chains the faults go into, empty for now.
    in_ns "$ns" "$IPTABLES" -w -N "$FAULT_CHAIN"
    in_ns "$ns" "$IPTABLES" -w -A INPUT -j "$FAULT_CHAIN"
    in_ns "$ns" "$IPTABLES" -w -A OUTPUT -j "$FAULT_CHAIN"
    in_ns "$ns" "$IPTABLES" -w -N "$IMPAIR_CHAIN"
    in_ns "$ns" "$IPTABLES" -w -A OUTPUT -j "$IMPAIR_CHAIN"
    echo "$name $ns $address" >> "$dir/hosts.partial"
  done
  mv "$dir/hosts.partial" "$dir/hosts"
  trap - ERR
  echo "fault-hosts: $prefix up: ${#names[@]} hosts on $subnet.0/24${rate:+, links of $rate}"
  while read -r name ns address; do echo "  $name  $address  (ip netns exec $ns ...)"; done < "$dir/hosts"
}

cmd_down() {
  local prefix="${1:-}"
  if [ "$prefix" = --prefix ]; then prefix="${2:-}"; fi
  valid_prefix "$prefix" || usage_error "down needs --prefix P"
  local dir="$STATE/$prefix" namespaces=() ns
  if [ -f "$dir/namespaces" ]; then
    mapfile -t namespaces < "$dir/namespaces"
  fi
  # Also those a half-made or half-removed set left without a record: P.sw and P.NAME only
  # (a prefix has no '.', so no other set's namespace matches).
  while read -r ns _; do
    [[ "$ns" =~ ^$prefix\.[a-z][a-z0-9]*$ ]] && namespaces+=("$ns")
  done < <(ip netns list 2>/dev/null)
  local removed=0 killed=0 pid
  for ns in $(printf '%s\n' "${namespaces[@]}" | sort -u); do
    ip netns list | awk '{print $1}' | grep -qx "$ns" || continue
    # Whatever still runs there was started there (a test's processes, the delayers).
    for pid in $(ip netns pids "$ns" 2>/dev/null); do
      if kill -KILL "$pid" 2>/dev/null; then killed=$((killed + 1)); fi
    done
    ip netns del "$ns" && removed=$((removed + 1))
  done
  rm -rf "$dir"
  echo "fault-hosts: $prefix down: $removed namespaces removed, $killed processes killed"
}

cmd_gc() {
  [ -d "$STATE" ] || { echo "fault-hosts: nothing to collect"; return 0; }
  local dir
  for dir in "$STATE"/*/; do
    [ -d "$dir" ] || continue
    dir="${dir%/}"
    if ! owner_alive "$dir"; then
      echo "fault-hosts: $(basename "$dir"): its owner ($(cut -d' ' -f1 "$dir/owner")) is gone"
      cmd_down "$(basename "$dir")"
    fi
  done
}

cmd_list() {
  [ -d "$STATE" ] || return 0
  local dir prefix
  for dir in "$STATE"/*/; do
    [ -d "$dir" ] || continue
    dir="${dir%/}"
    prefix="$(basename "$dir")"
    local owner="-" alive="alive"
    [ -f "$dir/owner" ] && owner="$(cut -d' ' -f1 "$dir/owner")"
    owner_alive "$dir" || alive="gone"
    echo "$prefix: owner $owner ($alive), hosts $(awk '{printf "%s=%s ", $1, $3}' "$dir/hosts" 2>/dev/null)"
  done
}

# -- partitions ------------------------------------------------------------------------------------

# Adds (or with -D removes) the rules in A's namespace that drop everything to and from B.
drop_rules() {
  local op="$1" ns="$2" peer="$3" rule
  for rule in "-s $peer" "-d $peer"; do
    # shellcheck disable=SC2086
    if [ "$op" = -A ]; then
      in_ns "$ns" "$IPTABLES" -w -C "$FAULT_CHAIN" $rule -j DROP 2>/dev/null \
        || in_ns "$ns" "$IPTABLES" -w -A "$FAULT_CHAIN" $rule -j DROP
    else
      while in_ns "$ns" "$IPTABLES" -w -D "$FAULT_CHAIN" $rule -j DROP 2>/dev/null; do :; done
    fi
  done
}

cmd_partition() {
  [ $# -eq 3 ] || usage_error "partition P A B"
  local prefix="$1" a="$2" b="$3"
  [ "$a" != "$b" ] || usage_error "partition: A and B are the same host"
  local ns_a ns_b addr_a addr_b
  ns_a="$(host_ns "$prefix" "$a")"
  ns_b="$(host_ns "$prefix" "$b")"
  addr_a="$(host_addr "$prefix" "$a")"
  addr_b="$(host_addr "$prefix" "$b")"
  drop_rules -A "$ns_a" "$addr_b"
  drop_rules -A "$ns_b" "$addr_a"
  echo "fault-hosts: $prefix: $a <-/-> $b"
}

cmd_isolate() {
  [ $# -ge 2 ] || usage_error "isolate P A [--except B,C]"
  local prefix="$1" a="$2" except=""
  shift 2
  if [ $# -gt 0 ]; then
    if [ "$1" != --except ] || [ $# -ne 2 ]; then usage_error "isolate P A [--except B,C]"; fi
    except=",$2,"
    local e
    for e in ${2//,/ }; do host_line "$prefix" "$e" >/dev/null; done
  fi
  host_line "$prefix" "$a" >/dev/null
  local other cut=() names
  names="$(host_names "$prefix")"
  for other in $names; do
    [ "$other" != "$a" ] || continue
    [[ "$except" == *",$other,"* ]] && continue
    cmd_partition "$prefix" "$a" "$other" >/dev/null
    cut+=("$other")
  done
  echo "fault-hosts: $prefix: $a cut off from ${cut[*]:-nobody}"
}

cmd_heal() {
  if [ $# -lt 1 ] || [ $# -gt 3 ]; then usage_error "heal P [A [B]]"; fi
  local prefix="$1" name ns
  if [ $# -eq 1 ]; then
    while read -r name ns _; do
      in_ns "$ns" "$IPTABLES" -w -F "$FAULT_CHAIN"
    done < "$(set_dir "$prefix")/hosts"
    echo "fault-hosts: $prefix: every partition healed"
  elif [ $# -eq 2 ]; then
    local a="$2" ns_a addr_a other_ns other_addr
    ns_a="$(host_ns "$prefix" "$a")"
    addr_a="$(host_addr "$prefix" "$a")"
    while read -r name other_ns other_addr; do
      [ "$name" != "$a" ] || continue
      drop_rules -D "$ns_a" "$other_addr"
      drop_rules -D "$other_ns" "$addr_a"
    done < "$(set_dir "$prefix")/hosts"
    echo "fault-hosts: $prefix: $a reaches every host again"
  else
    local ns_a ns_b addr_a addr_b
    ns_a="$(host_ns "$prefix" "$2")"
    ns_b="$(host_ns "$prefix" "$3")"
    addr_a="$(host_addr "$prefix" "$2")"
    addr_b="$(host_addr "$prefix" "$3")"
    drop_rules -D "$ns_a" "$addr_b"
    drop_rules -D "$ns_b" "$addr_a"
    echo "fault-hosts: $prefix: $2 <---> $3 healed"
  fi
}

# -- loss and delay --------------------------------------------------------------------------------

have_netem() {
  # Asked of the kernel, in a scratch namespace of the set: can a netem qdisc be made?
  local ns="$1"
  ip -n "$ns" link add impair-probe type dummy 2>/dev/null || return 1
  local ok=1
  tc -n "$ns" qdisc add dev impair-probe root netem delay 1ms 2>/dev/null && ok=0
  ip -n "$ns" link del impair-probe 2>/dev/null || true
  return $ok
}

impairer_binary() {
  local candidate
  for candidate in "${SHARD_NET_IMPAIR:-}" "$ROOT/${SHARD_BUILD_DIR:-build}/bin/shard-net-impair" \
                   "$ROOT/build/bin/shard-net-impair"; do
    [ -n "$candidate" ] && [ -x "$candidate" ] && { echo "$candidate"; return 0; }
  done
  return 1
}

# "5%" or "0.05" -> 0.05
loss_fraction() {
  local text="$1"
  if [[ "$text" =~ ^([0-9]*\.?[0-9]+)%$ ]]; then
    awk -v p="${BASH_REMATCH[1]}" 'BEGIN { printf "%.6f", p / 100 }'
  elif [[ "$text" =~ ^[0-9]*\.?[0-9]+$ ]]; then
    awk -v p="$text" 'BEGIN { printf "%.6f", p }'
  else
    usage_error "--loss takes a percentage (5%) or a fraction (0.05), not '$text'"
  fi
}

cmd_impair() {
  [ $# -ge 1 ] || usage_error "impair P [--delay 20ms] [--loss 5%] ..."
  local prefix="$1" delay="0ms" loss="0" jitter="0ms" only="" via=auto seed=1
  shift
  while [ $# -gt 0 ]; do
    case "$1" in
      --delay) delay="$2"; shift 2 ;;
      --loss) loss="$2"; shift 2 ;;
      --jitter) jitter="$2"; shift 2 ;;
      --hosts) only=",$2,"; shift 2 ;;
      --via) via="$2"; shift 2 ;;
      --seed) seed="$2"; shift 2 ;;
      *) usage_error "impair: unknown argument '$1'" ;;
    esac
  done
  [[ "$delay" =~ ^[0-9]+(\.[0-9]+)?(us|ms|s)$ ]] || usage_error "--delay takes e.g. 20ms"
  [[ "$jitter" =~ ^[0-9]+(\.[0-9]+)?(us|ms|s)$ ]] || usage_error "--jitter takes e.g. 5ms"
  [[ "$seed" =~ ^[0-9]+$ ]] || usage_error "--seed takes a number"
  local fraction
  fraction="$(loss_fraction "$loss")"
  local dir
  dir="$(set_dir "$prefix")"
  [ ! -f "$dir/impaired" ] || die "$prefix is impaired already ($(cat "$dir/impaired")); unimpair first"
  local first_ns
  first_ns="$(awk 'NR == 1 {print $2}' "$dir/hosts")"
  case "$via" in
    auto) if have_netem "$first_ns"; then via=netem; else via=nfqueue; fi ;;
    netem) have_netem "$first_ns" || die "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM); use --via nfqueue" ;;
    nfqueue) ;;
    *) usage_error "--via takes auto, netem or nfqueue" ;;
  esac
  local binary=""
  if [ "$via" = nfqueue ]; then
    binary="$(impairer_binary)" || die "the kernel has no netem and shard-net-impair is not built (scripts/build.sh --target shard-net-impair; it needs libnetfilter-queue-dev from scripts/setup.sh)"
  fi
  local percent
  percent="$(awk -v f="$fraction" 'BEGIN { printf "%.4f%%", f * 100 }')"
  local name ns i=0 done_hosts=()
  while read -r name ns _; do
    i=$((i + 1))
    [ -z "$only" ] || [[ "$only" == *",$name,"* ]] || continue
    if [ "$via" = netem ]; then
      # netem replaces the host's tbf; it keeps the link's speed with its own rate.
      local rate
      rate="$(cat "$dir/rate" 2>/dev/null || true)"
      # shellcheck disable=SC2086
      tc -n "$ns" qdisc replace dev eth0 root netem delay "$delay" "$jitter" loss "$percent" \
        ${rate:+rate $rate}
    else
      # The delayer first, bound to its queue, then the rule that feeds it.
      local log="$dir/impair-$name.log"
      ip netns exec "$ns" setsid "$binary" --queue "$IMPAIR_QUEUE" --delay "$delay" \
        --jitter "$jitter" --loss "$fraction" --seed "$((seed + i))" \
        > "$log" 2>&1 < /dev/null &
      local pid=$!
      echo "$pid" > "$dir/impair-$name.pid"
      local tries=0
      until grep -q "^shard-net-impair: queue" "$log" 2>/dev/null; do
        running "$pid" || die "shard-net-impair on $name exited: $(cat "$log")"
        tries=$((tries + 1)); [ $tries -lt 250 ] || die "shard-net-impair on $name did not start"
        sleep 0.02
      done
      in_ns "$ns" "$IPTABLES" -w -A "$IMPAIR_CHAIN" -o eth0 -j NFQUEUE --queue-num "$IMPAIR_QUEUE"
    fi
    done_hosts+=("$name")
  done < "$dir/hosts"
  echo "via $via: delay $delay jitter $jitter loss $percent on ${done_hosts[*]}" > "$dir/impaired"
  echo "fault-hosts: $prefix: every packet ${done_hosts[*]} send$([ ${#done_hosts[@]} -eq 1 ] && echo s) is delayed $delay (jitter $jitter) and lost with probability $percent (via $via)"
}

cmd_unimpair() {
  [ $# -eq 1 ] || usage_error "unimpair P"
  local prefix="$1" dir name ns
  dir="$(set_dir "$prefix")"
  while read -r name ns _; do
    # The rule goes first, then the delayer, which lets the packets it holds go: none is lost.
    in_ns "$ns" "$IPTABLES" -w -F "$IMPAIR_CHAIN"
    if tc -n "$ns" qdisc show dev eth0 | grep -q netem; then
      tc -n "$ns" qdisc del dev eth0 root
      local rate
      rate="$(cat "$dir/rate" 2>/dev/null || true)"
      [ -z "$rate" ] || set_rate "$ns" "$rate"
    fi
    if [ -f "$dir/impair-$name.pid" ]; then
      local pid
      pid="$(cat "$dir/impair-$name.pid")"
      if kill -TERM "$pid" 2>/dev/null; then
        local tries=0
        while running "$pid" && [ $tries -lt 100 ]; do sleep 0.02; tries=$((tries + 1)); done
        kill -KILL "$pid" 2>/dev/null || true
      fi
      rm -f "$dir/impair-$name.pid"
    fi
  done < "$dir/hosts"
  rm -f "$dir/impaired"
  echo "fault-hosts: $prefix: every link clean"
}

cmd_faults() {
  [ $# -eq 1 ] || usage_error "faults P"
  local prefix="$1" dir name ns address
  dir="$(set_dir "$prefix")"
  declare -A by_address
  while read -r name ns address; do by_address[$address]="$name"; done < "$dir/hosts"
  local pairs=()
  while read -r name ns address; do
    local peer
    for peer in $(in_ns "$ns" "$IPTABLES" -w -S "$FAULT_CHAIN" | sed -n 's/^-A [^ ]* -d \([0-9.]*\)\/32 -j DROP$/\1/p'); do
      pairs+=("$name->${by_address[$peer]:-$peer}")
    done
  done < "$dir/hosts"
  if [ ${#pairs[@]} -eq 0 ]; then echo "partitions: none"; else echo "partitions (dropped): ${pairs[*]}"; fi
  if [ -f "$dir/impaired" ]; then echo "impaired: $(cat "$dir/impaired")"; else echo "impaired: none"; fi
  echo "link speed: $(grep . "$dir/rate" 2>/dev/null || echo unlimited)"
}

cmd_check() {
  local ok=0
  if [ "$(id -u)" -ne 0 ]; then echo "root: no (network namespaces and iptables need root)"; ok=1; else echo "root: yes"; fi
  if command -v ip >/dev/null && ip netns list >/dev/null 2>&1; then echo "ip netns: yes"; else echo "ip netns: no (iproute2)"; ok=1; fi
  if command -v "$IPTABLES" >/dev/null; then echo "iptables: $("$IPTABLES" --version 2>/dev/null)"; else echo "iptables: no (scripts/setup.sh installs it)"; ok=1; fi
  if [ $ok -eq 0 ]; then
    local probe="fhcheck$$"
    if ip netns add "$probe.sw" 2>/dev/null; then
      if have_netem "$probe.sw"; then echo "netem: yes"; else echo "netem: no (the kernel lacks sch_netem; impair uses shard-net-impair)"; fi
      ip netns del "$probe.sw"
    else
      echo "ip netns add: fails (no CAP_SYS_ADMIN?)"; ok=1
    fi
  fi
  if binary="$(impairer_binary)"; then echo "shard-net-impair: $binary"; else echo "shard-net-impair: not built"; fi
  return $ok
}

# -- main ------------------------------------------------------------------------------------------

[ $# -gt 0 ] || { usage; exit 2; }
command="$1"
shift
# The commands on a set: the set is up (and the hosts named exist), or one message says why.
case "$command" in
  exec|addr|ns|hosts|partition|isolate|heal|impair|unimpair|faults)
    [ $# -ge 1 ] || usage_error "$command needs the prefix of a set of hosts"
    set_dir "$1" >/dev/null ;;
esac
case "$command" in
  -h|--help|help) usage ;;
  up) cmd_up "$@" ;;
  down) cmd_down "$@" ;;
  exec)
    [ $# -ge 3 ] || usage_error "exec P HOST COMMAND..."
    ns="$(host_ns "$1" "$2")"
    shift 2
    exec ip netns exec "$ns" "$@" ;;
  addr) [ $# -eq 2 ] || usage_error "addr P HOST"; host_addr "$1" "$2" ;;
  ns) [ $# -eq 2 ] || usage_error "ns P HOST"; host_ns "$1" "$2" ;;
  hosts) [ $# -eq 1 ] || usage_error "hosts P"; cat "$(set_dir "$1")/hosts" ;;
  partition) cmd_partition "$@" ;;
  isolate) cmd_isolate "$@" ;;
  heal) cmd_heal "$@" ;;
  impair) cmd_impair "$@" ;;
  unimpair) cmd_unimpair "$@" ;;
  faults) cmd_faults "$@" ;;
  list) cmd_list ;;
  gc) cmd_gc ;;
  check) cmd_check ;;
  *) usage_error "unknown command '$command'" ;;
esac
