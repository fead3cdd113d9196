# Sourced by scripts/h2load and scripts/profile: starts target/release/kas-local (Redis,
# three kas, agents) in a temporary directory, stopped on exit, and sets
#   pid         kas-local's process (every kas and agent runs in it)
#   home        the kas holding agent 1's tunnels; local_api / remote_api: the public API
#               of that kas and of another one
#   h2load_call h2load's arguments for GetPods of agent 1 (a JWT as GitLab signs it, HS256
#               with gitlab.secret; the body is GetPodsRequest{agent_id: 1} in gRPC framing),
#               to be followed by the kas API address
command -v h2load >/dev/null || apt-get install -y nghttp2-client >/dev/null
kas_local=target/release/kas-local
[ -x "$kas_local" ] || { echo "build it first: cargo build --release --bin kas-local" >&2; exit 1; }

dir=$(mktemp -d)
"$kas_local" --dir "$dir/deploy" >"$dir/out" 2>&1 &
pid=$!
trap 'kill -INT $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 100); do grep -q "Ctrl-C stops" "$dir/out" && break; sleep 0.2; done
grep -q "Ctrl-C stops" "$dir/out" || { cat "$dir/out" >&2; exit 1; }

home=$(awk '$1 == "agent" && $2 == "1" {for (i = 3; i < NF; i++) if ($i == "on") {print $(i + 1); exit}}' "$dir/out")
local_api=$(awk -v k="$home" '$1 == k {print $5}' "$dir/out")
remote_api=$(awk -v k="$home" '$1 ~ /^kas[0-9]$/ && $1 != k {print $5; exit}' "$dir/out")

token=$(python3 - "$dir/deploy/gitlab.secret" <<'EOF'
import base64, hashlib, hmac, json, sys, time
key = base64.b64decode(open(sys.argv[1]).read().strip())
b64 = lambda b: base64.urlsafe_b64encode(b).rstrip(b"=").decode()
now = int(time.time())
head = b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
claims = b64(json.dumps({"iss": "gitlab", "aud": "gitlab-kas", "iat": now, "nbf": now - 5, "exp": now + 3000}).encode())
sig = b64(hmac.new(key, f"{head}.{claims}".encode(), hashlib.sha256).digest())
print(f"{head}.{claims}.{sig}")
EOF
)
printf '\x00\x00\x00\x00\x02\x08\x01' >"$dir/body"
h2load_call=(-d "$dir/body" -H "content-type: application/grpc" -H "te: trailers"
  -H "grpc-timeout: 10S" -H "authorization: Bearer $token")
grpc_path=/kas.public_api.KasApi/GetPods
