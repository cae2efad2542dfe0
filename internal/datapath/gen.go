package datapath

//go:generate go tool bpf2go -cc clang -cflags "-mcpu=v3 -O2 -g -Wall -Werror -I/usr/include/x86_64-linux-gnu" -target bpfel -type dysco_tuple -type dysco_ends -type flow_val -type flow_val4 -type dysco_tuple4 -type dysco_ends4 -type session_val -type syn_state -type delta_val -type policy_val -type type_val -type trusted_key -type mac_key -type tp_key -type tp_val -type tp_req -type agent_state -type ctl_args dysco ../../bpf/dysco.c -- -I../../bpf/include
