package cli

import (
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"

	"github.com/spf13/cobra"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/certs"
	"github.com/dysco/dysco/internal/policy"
	"github.com/dysco/dysco/internal/policyserver"
)

func init() { register(newPolicyServerCmd) }

// policyServerValidatePolicy checks a policy's filter with libpcap before
// the policy server stores it (policyserver.Config.ValidatePolicy).
var policyServerValidatePolicy = func(p api.Policy) error {
	_, err := policy.Compile(p)
	return err
}

func newPolicyServerCmd() *cobra.Command {
	var (
		cfg    policyserver.Config
		debug  bool
		pkiDir string
	)
	cmd := &cobra.Command{
		Use:   "policy-server",
		Short: "Run the policy server, which stores policies and hands them to the agents",
		Long: `Run the policy server (paper §2.2): it keeps policies and middlebox types in
a bbolt database (--db), or in an etcd cluster (--etcd: any number of policy
servers then serve the same set, each a stateless replica; docs/etcd.md), or
in Kubernetes custom resources (--kubernetes, built into dysco-kube;
docs/kubernetes.md), and serves them over HTTPS/JSON. Agents started with its
URL long-poll /v1/watch for the policies meant for them, and keep their last
set while it is down. Operators change policies with "dysco policy add --server URL".

Clients authenticate with certificates of the deployment's CA ("dysco certs"),
whose role decides what they may do: operator (policies, types, operations),
agent (its own policies and operations; its name is the certificate's) and
monitor (read only). A request without a valid certificate is answered 401,
one beyond its role 403; both are counted in the metrics. The server does not
start without its certificate (--pki-dir, or --tls-cert, --tls-key,
--client-ca) unless --insecure is given, which serves plain HTTP with no
authentication at all. Metrics are served on their own plain-HTTP listener,
--metrics-listen (loopback by default).

It also relays operator verbs to named agents: "dysco reconfig --server URL
--host H ..." and "dysco middlebox remove|replace --server URL --host H ..."
run on agent H as if typed there, and print its results. Agents claim them
by long-polling /v1/operations/claim. Operations live in the server's memory,
or in etcd or Kubernetes with those stores, where any replica serves them.

Routes: GET /v1/policies, PUT|DELETE /v1/policies/NAME, PUT|DELETE /v1/types/NAME,
GET /v1/watch?host=H&after=V[&wait=S], GET /v1/agents, POST|GET /v1/operations,
GET /v1/operations/ID[?wait=S], POST /v1/operations/claim?host=H[&wait=S],
PUT /v1/operations/ID/result, GET /healthz; on --metrics-listen: GET /metrics,
GET /healthz.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			level := slog.LevelInfo
			if debug {
				level = slog.LevelDebug
			}
			cfg.Logger = slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), &slog.HandlerOptions{Level: level}))
			if cmd.Flags().Changed("db") && (len(cfg.Etcd) > 0 || cfg.Kubernetes) {
				return errors.New("--db is the bbolt store's file: with --etcd or --kubernetes the policies are kept there instead, give one store")
			}
			if !cfg.Insecure {
				dc, dk := certs.Paths(pkiDir, certs.ServerName)
				if cfg.CertFile == "" {
					cfg.CertFile = dc
				}
				if cfg.KeyFile == "" {
					cfg.KeyFile = dk
				}
				if cfg.ClientCAFile == "" {
					cfg.ClientCAFile = filepath.Join(pkiDir, certs.CAFile)
				}
			}
			cfg.ValidatePolicy = policyServerValidatePolicy
			cfg.ValidateMatch = func(m string) error { _, err := policy.CompileMatch(m); return err }
			return policyserver.Run(cmd.Context(), cfg)
		},
	}
	f := cmd.Flags()
	f.StringVar(&cfg.Listen, "listen", policyserver.DefaultListen, "TCP address to serve on")
	f.StringVar(&cfg.DB, "db", policyserver.DefaultDB, "bbolt database file (its directory is created); refused with --etcd or --kubernetes")
	f.DurationVar(&cfg.AgentTTL, "agent-ttl", 0, "how long an agent stays registered without a word from it (its polls renew it while they wait): operations for it are refused after that; default 45s, at least 2s")
	f.BoolVar(&cfg.Kubernetes, "kubernetes", false, "keep the policies in Kubernetes custom resources (deploy/crds) instead of --db; policy servers are then stateless replicas (docs/kubernetes.md)")
	f.StringVar(&cfg.Kubeconfig, "kubeconfig", "", "with --kubernetes: kubeconfig file of the API server (default: the pod's service account)")
	f.StringVar(&cfg.KubeNamespace, "kube-namespace", policyserver.DefaultKubeNamespace, "with --kubernetes: namespace of the published set and the Leases")
	f.DurationVar(&cfg.KubeLease, "kube-lease", 0, "with --kubernetes: the controller's leader lease; a controller that dies is replaced within it (default 15s)")
	f.StringSliceVar(&cfg.Etcd, "etcd", nil, "keep the policies in this etcd cluster instead of --db: its client URLs, comma-separated; policy servers are then stateless replicas (docs/etcd.md)")
	f.StringVar(&cfg.EtcdPrefix, "etcd-prefix", policyserver.DefaultEtcdPrefix, "key prefix of the policy set in etcd")
	f.StringVar(&cfg.EtcdCertFile, "etcd-cert", "", "client certificate for etcd (https:// URLs with client authentication)")
	f.StringVar(&cfg.EtcdKeyFile, "etcd-key", "", "its key")
	f.StringVar(&cfg.EtcdCAFile, "etcd-ca", "", "CA certificate of etcd's server certificate")
	f.StringVar(&pkiDir, "pki-dir", defaultPKIDir(), "directory of the server's certificate (server.crt, server.key) and the CA (ca.crt) of the clients' (made by dysco certs; env DYSCO_PKI_DIR)")
	f.StringVar(&cfg.CertFile, "tls-cert", "", "the server's certificate (default PKI-DIR/server.crt)")
	f.StringVar(&cfg.KeyFile, "tls-key", "", "the server's key (default PKI-DIR/server.key)")
	f.StringVar(&cfg.ClientCAFile, "client-ca", "", "CA certificate that signs the clients' certificates (default PKI-DIR/ca.crt)")
	f.StringVar(&cfg.CRLFile, "crl", "", "the CA's revocation list (dysco certs revoke), read again when it changes; none there revokes nothing (default: crl.pem beside --client-ca)")
	f.BoolVar(&cfg.Insecure, "insecure", false, "serve plain HTTP with no authentication: anyone who reaches the server may change policies and run operations on the agents")
	f.StringVar(&cfg.MetricsListen, "metrics-listen", policyserver.DefaultMetricsListen, "serve /metrics (plain HTTP, no authentication) on this address; empty: no metrics")
	f.StringVar(&cfg.ReadyFile, "ready-file", "", "file to write the listening address to once serving (removed on exit)")
	f.BoolVar(&debug, "debug", false, "log at debug level")
	cmd.AddCommand(newPolicyServerCheckCmd(), newPolicyServerBackupCmd())
	return cmd
}

func newPolicyServerCheckCmd() *cobra.Command {
	var db string
	cmd := &cobra.Command{
		Use:   "check",
		Short: "Check the policy server's database",
		Long: `Check the policy server's database: every bbolt page, and every policy and
type decoded. It prints the version and the counts of a sound database, and
fails (exit status 1) with what is wrong with a damaged one. The server using
the file must be stopped. At each start that finds its database sound, the
server copies it to FILE.bak.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			sum, err := policyserver.Check(db)
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s: sound: version %d, %d policies, %d types\n", db, sum.Version, sum.Policies, sum.Types)
			return nil
		},
	}
	cmd.Flags().StringVar(&db, "db", policyserver.DefaultDB, "bbolt database file")
	return cmd
}

func newPolicyServerBackupCmd() *cobra.Command {
	var db, out string
	cmd := &cobra.Command{
		Use:   "backup",
		Short: "Copy the policy server's database, once it checks out",
		Long: `Check the policy server's database as "check" does and copy it to --out
(written whole or not at all). A damaged database is not copied. The server
using the file must be stopped; it copies its database to FILE.bak itself at
each start that finds it sound.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if out == "" {
				return fmt.Errorf("backup needs --out FILE")
			}
			sum, err := policyserver.Backup(db, out)
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s copied to %s: version %d, %d policies, %d types\n", db, out, sum.Version, sum.Policies, sum.Types)
			return nil
		},
	}
	cmd.Flags().StringVar(&db, "db", policyserver.DefaultDB, "bbolt database file")
	cmd.Flags().StringVar(&out, "out", "", "file to write the copy to")
	return cmd
}
