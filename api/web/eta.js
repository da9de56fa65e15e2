// The prefill ETA, from measured progress only.
//
// A request's first progress event marks its arrival (0 tokens), and the step to the second holds
// no prefill worth timing: the time it waited in the queue, or a prefix-cache hit that jumps ahead
// at once (0 -> 78 of 2514 tokens in 1.5 ms once gave "ETA 47 ms" for a prompt that took seconds).
// So the rate is measured from the second event on, and there is no ETA before a third, unless an
// earlier request of the same model measured one in this page: then that rate gives the ETA from
// the first event.

const remembered = new Map(); // model -> prompt tokens/s measured by this page's earlier requests

export class PrefillEta {
  constructor(model) {
    this.model = model;
    this.seen = 0;
    this.base = null; // the second event: { done, at }
    this.rate = null; // tokens/s measured for this request
  }

  /** One progress event (`now` in ms); the seconds left, or null while no rate is known. */
  see(done, total, now) {
    this.seen += 1;
    if (this.seen === 2) this.base = { done, at: now };
    else if (this.base && done > this.base.done && now > this.base.at) {
      this.rate = (done - this.base.done) / ((now - this.base.at) / 1000);
      remembered.set(this.model, this.rate);
    }
    const rate = this.rate || remembered.get(this.model);
    return rate > 0 ? Math.max(0, total - done) / rate : null;
  }
}
