package lab

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
)

// WriteNginxConfig writes dir/nginx.conf for an nginx that runs in the
// foreground (`nginx -c dir/nginx.conf -p dir`), keeps its pid, logs and
// temporary files under dir, and serves dir/www on port of each address.
// It creates dir/www and returns the configuration's path. Keep-alive
// connections serve any number of requests.
func WriteNginxConfig(dir string, port int, addrs ...netip.Addr) (string, error) {
	return WriteNginxConfigKeepalive(dir, port, 1000000, addrs...)
}

// WriteNginxConfigKeepalive is WriteNginxConfig with nginx closing each
// keep-alive connection after keepaliveRequests requests (its
// keepalive_requests): the client then opens a new one.
func WriteNginxConfigKeepalive(dir string, port, keepaliveRequests int, addrs ...netip.Addr) (string, error) {
	var listen strings.Builder
	for _, a := range addrs {
		if a.Is6() {
			fmt.Fprintf(&listen, "    listen [%s]:%d;\n", a, port)
		} else {
			fmt.Fprintf(&listen, "    listen %s:%d;\n", a, port)
		}
	}
	cfg := fmt.Sprintf(`user root;
worker_processes 1;
daemon off;
pid %[1]s/nginx.pid;
error_log stderr warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path %[1]s/body;
  proxy_temp_path %[1]s/proxy;
  fastcgi_temp_path %[1]s/fastcgi;
  uwsgi_temp_path %[1]s/uwsgi;
  scgi_temp_path %[1]s/scgi;
  sendfile on;
  keepalive_requests %[3]d;
  server {
%[2]s    root %[1]s/www;
  }
}
`, dir, listen.String(), keepaliveRequests)
	if err := os.MkdirAll(filepath.Join(dir, "www"), 0o755); err != nil {
		return "", err
	}
	path := filepath.Join(dir, "nginx.conf")
	return path, os.WriteFile(path, []byte(cfg), 0o644)
}
