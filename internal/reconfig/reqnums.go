package reconfig

// Request numbers that survive an agent restart (protocol.Config.FirstReq).

// Request numbers are reserved in blocks of reqBlock, a new block once the
// latest request is within reqMargin of the reserved limit (one event
// numbers at most one request).
const (
	reqBlock  = 4096
	reqMargin = 64
)

// loadReqs starts this agent's request numbers above those an earlier
// agent on this host may have used (protocol.Config.FirstReq).
func (c *Shell) loadReqs() error {
	hi, err := c.dp.ReqHigh()
	if err != nil {
		return err
	}
	c.reqBase, c.reqLimit = hi, hi
	return c.reserveReqs()
}

// reserveReqs raises the limit of request numbers kept in the datapath.
func (c *Shell) reserveReqs() error {
	limit := c.reqLimit + reqBlock
	if err := c.dp.SetReqHigh(limit); err != nil {
		c.log.Warn("control: cannot keep the request numbers for a restart", "err", err)
		return err
	}
	c.reqLimit = limit
	return nil
}
