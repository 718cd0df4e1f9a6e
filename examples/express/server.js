// A small payments service with no idempotency of its own: every POST /payments charges
// again. Run it behind `idem proxy` and a retried POST charges once.
//
// What it does with the two headers the proxy sends on, `Idempotency-Key` and
// `Idempotency-Attempt`: attempt 1 is the key's first run. An attempt above 1 means that an
// earlier attempt's outcome is unknown (the upstream's answer was lost, or the proxy died
// while it worked): it may have charged, and may even still be charging. So before charging
// again it looks in its own ledger, by caller and key, and answers with the charge it finds
// (waiting for one still running) instead of making a second one.
//
//   PORT=3000 node server.js
//
// POST /payments {"amount": 1250, "currency": "EUR"}  -> 201 and the payment (a charge)
// GET  /payments                                      -> every charge made, to count them
// `X-Delay-Ms: <n>` makes a charge take that long, to watch retries meet it in flight.
const express = require("express");

const app = express();
app.use(express.json());

const payments = [];
// The ledger of charges by caller and idempotency key: each entry the promise of its
// payment, so that a later attempt finds a charge still running as well as a finished one.
const charges = new Map();

app.post("/payments", async (req, res) => {
  const { amount, currency } = req.body ?? {};
  if (!Number.isInteger(amount) || amount <= 0 || typeof currency !== "string") {
    return res
      .status(400)
      .type("application/problem+json")
      .send({ title: "Invalid payment", detail: "amount (a positive integer) and currency expected" });
  }
  const idempotencyKey = req.get("Idempotency-Key") ?? null;
  const attempt = Number(req.get("Idempotency-Attempt") ?? 1);
  const entry = idempotencyKey && `${req.get("Authorization") ?? ""}\n${idempotencyKey}`;
  if (attempt > 1 && entry && charges.has(entry)) {
    // An earlier attempt charged (or is charging): its payment, not a second charge.
    const earlier = await charges.get(entry);
    return res.status(201).location(`/payments/${earlier.id}`).json(earlier);
  }
  const charge = (async () => {
    const payment = {
      id: `pay_${payments.length + 1}`,
      amount,
      currency,
      idempotencyKey,
      attempt,
    };
    payments.push(payment); // the side effect: a charge
    const delay = Number(req.get("X-Delay-Ms") ?? 0);
    if (delay > 0) await new Promise((resolve) => setTimeout(resolve, Math.min(delay, 60000)));
    return payment;
  })();
  if (entry) charges.set(entry, charge);
  const payment = await charge;
  res.status(201).location(`/payments/${payment.id}`).json(payment);
});

app.get("/payments", (_req, res) => res.json({ count: payments.length, payments }));

const port = Number(process.env.PORT ?? 3000);
const server = app.listen(port, "127.0.0.1", () => {
  console.log(`express payments listening on http://127.0.0.1:${server.address().port}`);
});
process.on("SIGTERM", () => server.close(() => process.exit(0)));
