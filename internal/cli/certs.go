package cli

import (
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"time"

	"github.com/spf13/cobra"

	"github.com/dysco/dysco/internal/certs"
)

func init() { register(newCertsCmd) }

func newCertsCmd() *cobra.Command {
	var (
		dir   string
		days  int
		force bool
	)
	opts := func() certs.Options { return certs.Options{Days: days, Force: force} }
	cmd := &cobra.Command{
		Use:   "certs",
		Short: "Create the CA and the certificates of the policy server and its clients",
		Long: `Create a certificate authority for the management plane and issue, under it,
the policy server's certificate and the client certificates that carry an
identity and a role to the policy server (mutual TLS):

  operator  may change policies and types and send operations to agents
  agent     may watch its own policies and claim and report its own operations;
            its name (the certificate's common name) is the agent's --name
  monitor   may read: list policies and operations

Files go to --dir (default /etc/dysco/pki, or $DYSCO_PKI_DIR): ca.crt and
ca.key, server.crt and server.key, agent-NAME.crt and .key, operator.crt,
monitor.crt (ROLE-NAME.crt for another name). Keys are written readable by
their owner only (0600); existing files are not overwritten without --force.
Keep ca.key on the machine that issues certificates; every host needs ca.crt
and its own certificate and key. The CA lives 10 years and the certificates
it issues 1 year unless --days says otherwise. "dysco certs revoke" puts
certificates on the CA's revocation list (crl.pem), which the policy server
reads.`,
		Example: `  dysco certs ca
  dysco certs server --ip 10.0.0.9 --dns ps.example.net
  dysco certs agent h1 mb1 server1
  dysco certs operator
  dysco certs monitor
  dysco certs revoke agent-mb1 operator-alice`,
	}
	pf := cmd.PersistentFlags()
	pf.StringVar(&dir, "dir", defaultPKIDir(), "directory of the CA and the certificates (env DYSCO_PKI_DIR)")
	pf.IntVar(&days, "days", 0, fmt.Sprintf("lifetime in days (default %d for the CA, %d for the others)", certs.DefaultCADays, certs.DefaultLeafDays))
	pf.BoolVar(&force, "force", false, "overwrite existing files")

	var caName string
	ca := &cobra.Command{
		Use:   "ca",
		Short: "Create the certificate authority (ca.crt, ca.key)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			p, err := certs.CreateCA(dir, caName, opts())
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "CA created: %s, %s (keep the key on this machine)\n", p, filepath.Join(dir, certs.CAKeyFile))
			return nil
		},
	}
	ca.Flags().StringVar(&caName, "name", "dysco CA", "the CA's common name")

	var (
		dnsNames []string
		ips      []string
	)
	server := &cobra.Command{
		Use:   "server --ip ADDR[,ADDR] [--dns NAME[,NAME]]",
		Short: "Issue the policy server's certificate (server.crt, server.key)",
		Long: `Issue the policy server's certificate, for the addresses (--ip) and names
(--dns) that clients put in its URL: a client refuses a server whose
certificate does not name the host of the URL.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var addrs []netip.Addr
			for _, s := range ips {
				a, err := netip.ParseAddr(s)
				if err != nil {
					return fmt.Errorf("--ip %q: not an IP address", s)
				}
				addrs = append(addrs, a)
			}
			c, k, err := certs.IssueServer(dir, dnsNames, addrs, opts())
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "server certificate: %s, key %s\n", c, k)
			return nil
		},
	}
	server.Flags().StringSliceVar(&dnsNames, "dns", nil, "DNS names of the policy server")
	server.Flags().StringSliceVar(&ips, "ip", nil, "IP addresses of the policy server")

	issue := func(role string) func(*cobra.Command, []string) error {
		return func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				args = []string{role}
			}
			for _, name := range args {
				c, k, err := certs.IssueClient(dir, role, name, opts())
				if err != nil {
					return fmt.Errorf("%s %q: %w", role, name, err)
				}
				fmt.Fprintf(cmd.OutOrStdout(), "%s certificate of %q: %s, key %s\n", role, name, c, k)
			}
			return nil
		}
	}
	agentCmd := &cobra.Command{
		Use:   "agent NAME [NAME...]",
		Short: "Issue agent certificates (agent-NAME.crt): NAME is the agent's --name",
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) == 0 {
				return errors.New("missing NAME: the --name of the agent (by default its host name), e.g. dysco certs agent h1")
			}
			return nil
		},
		RunE: issue(certs.RoleAgent),
	}
	operator := &cobra.Command{
		Use:   "operator [NAME...]",
		Short: "Issue operator certificates (operator.crt, or operator-NAME.crt)",
		RunE:  issue(certs.RoleOperator),
	}
	monitor := &cobra.Command{
		Use:   "monitor [NAME...]",
		Short: "Issue read-only monitor certificates (monitor.crt, or monitor-NAME.crt)",
		RunE:  issue(certs.RoleMonitor),
	}
	revoke := &cobra.Command{
		Use:   "revoke CERT [CERT...]",
		Short: "Put certificates on the CA's revocation list (crl.pem)",
		Long: `Put certificates on the CA's revocation list, DIR/crl.pem, signed with the
CA's key: the policy server refuses them (401, counted with reason
"revoked"), also on connections open already. CERT is a certificate file,
or its base name in --dir (agent-mb1, operator, monitor-ci). The list keeps
what it held; revoking a certificate twice lists it once.

Copy crl.pem to every policy server beside its ca.crt (or where --crl
says): a running server reads it again within a second of its change,
without a restart. Issue the holder a new certificate with --force if it
should keep its access.`,
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) == 0 {
				return errors.New("missing CERT: a certificate file, or its base name in --dir (e.g. agent-mb1)")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			var files []string
			for _, a := range args {
				files = append(files, certs.CertFile(dir, a))
			}
			path, number, revoked, err := certs.Revoke(dir, files, time.Now())
			if err != nil {
				return err
			}
			for _, c := range revoked {
				id, _ := certs.IdentityOf(c)
				fmt.Fprintf(cmd.OutOrStdout(), "revoked %s %q (serial %X)\n", id.Role, c.Subject.CommonName, c.SerialNumber)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "revocation list %s (number %s): copy it to every policy server\n", path, number)
			return nil
		},
	}
	cmd.AddCommand(ca, server, agentCmd, operator, monitor, revoke)
	return cmd
}
