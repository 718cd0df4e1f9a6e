// A small payments service with no idempotency of its own: every POST /payments charges
// again. Run it behind `idem proxy` and a retried POST charges once.
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

app.post("/payments", async (req, res) => {
  const { amount, currency } = req.body ?? {};
  if (!Number.isInteger(amount) || amount <= 0 || typeof currency !== "string") {
    return res
      .status(400)
      .type("application/problem+json")
      .send({ title: "Invalid payment", detail: "amount (a positive integer) and currency expected" });
  }
  const payment = {
    id: `pay_${payments.length + 1}`,
    amount,
    currency,
    // What idem proxy sends on: the key, and 2 or more when an earlier attempt's outcome
    // was lost (check before charging again).
    idempotencyKey: req.get("Idempotency-Key") ?? null,
    attempt: Number(req.get("Idempotency-Attempt") ?? 1),
  };
  payments.push(payment); // the side effect: a charge
  const delay = Number(req.get("X-Delay-Ms") ?? 0);
  if (delay > 0) await new Promise((resolve) => setTimeout(resolve, Math.min(delay, 60000)));
  res.status(201).location(`/payments/${payment.id}`).json(payment);
});

app.get("/payments", (_req, res) => res.json({ count: payments.length, payments }));

const port = Number(process.env.PORT ?? 3000);
const server = app.listen(port, "127.0.0.1", () => {
  console.log(`express payments listening on http://127.0.0.1:${server.address().port}`);
});
process.on("SIGTERM", () => server.close(() => process.exit(0)));
