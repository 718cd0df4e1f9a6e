// An MCP server built with the official TypeScript SDK, with no idempotency of its own:
// every `tools/call` of `charge` charges again. Run it behind `idem proxy` with a JSON-RPC
// route, and a retried call (same idempotency key, new JSON-RPC id) charges once.
//
//   ADDR=127.0.0.1:3001 node server.js                  # answers each call as an SSE stream
//   ADDR=127.0.0.1:3001 JSON_RESPONSE=1 node server.js  # answers each call as one JSON body
//   PORT=0 node server.js                               # a free port on 127.0.0.1
//
// POST /mcp       MCP over Streamable HTTP (stateless: a server and transport per request)
// GET  /charges   every charge made, to count them
const http = require("node:http");
const { McpServer } = require("@modelcontextprotocol/sdk/server/mcp.js");
const { StreamableHTTPServerTransport } = require("@modelcontextprotocol/sdk/server/streamableHttp.js");
const { z } = require("zod");

const charges = [];
// The ledger of charges by caller and idempotency key: each entry the promise of its charge,
// so that a later attempt finds a charge still running as well as a finished one.
const ledger = new Map();

function mcpServer() {
  const server = new McpServer({ name: "idem-charge-example", version: "1.0.0" });
  server.registerTool(
    "charge",
    {
      description: "Charges the customer. Every call charges again: it is not idempotent.",
      inputSchema: {
        amount: z.number().int().positive(),
        currency: z.string(),
        // How long the charge takes, to watch retries meet it in flight.
        delay_ms: z.number().int().min(0).max(60000).optional(),
      },
    },
    async ({ amount, currency, delay_ms }, extra) => {
      // `idem proxy` sends `Idempotency-Attempt`: above 1, an earlier attempt of this key
      // may have charged (its proxy died, its answer was lost), and may still be charging.
      // Its charge is the answer then, not a second one.
      const headers = extra.requestInfo?.headers ?? {};
      const key = extra._meta?.idempotencyKey;
      const entry = key && `${headers.authorization ?? ""}\n${key}`;
      if (Number(headers["idempotency-attempt"] ?? 1) > 1 && entry && ledger.has(entry)) {
        return answer(await ledger.get(entry));
      }
      const charging = (async () => {
        const charge = { id: `ch_${charges.length + 1}`, amount, currency };
        charges.push(charge); // the side effect
        if (delay_ms) await new Promise((resolve) => setTimeout(resolve, delay_ms));
        return charge;
      })();
      if (entry) ledger.set(entry, charging);
      return answer(await charging);
    },
  );
  return server;
}

function answer(charge) {
  const text = `charged ${charge.amount} ${charge.currency}: ${charge.id}`;
  return { content: [{ type: "text", text }], structuredContent: charge };
}

function readBody(req) {
  return new Promise((resolve, reject) => {
    const chunks = [];
    req.on("data", (chunk) => chunks.push(chunk));
    req.on("end", () => resolve(Buffer.concat(chunks).toString("utf8")));
    req.on("error", reject);
  });
}

const httpServer = http.createServer(async (req, res) => {
  if (req.method === "GET" && req.url === "/charges") {
    res.writeHead(200, { "content-type": "application/json" });
    return res.end(JSON.stringify({ count: charges.length, charges }));
  }
  if (req.url !== "/mcp" || req.method !== "POST") {
    // Stateless: no session stream to GET, no session to DELETE.
    res.writeHead(405, { "content-type": "application/json", allow: "POST" });
    const error = { code: -32000, message: "Method not allowed." };
    return res.end(JSON.stringify({ jsonrpc: "2.0", error, id: null }));
  }
  let body;
  try {
    body = JSON.parse(await readBody(req));
  } catch {
    res.writeHead(400, { "content-type": "application/json" });
    const error = { code: -32700, message: "Parse error" };
    return res.end(JSON.stringify({ jsonrpc: "2.0", error, id: null }));
  }
  const server = mcpServer();
  const transport = new StreamableHTTPServerTransport({
    sessionIdGenerator: undefined,
    enableJsonResponse: process.env.JSON_RESPONSE === "1",
  });
  res.on("close", () => {
    transport.close();
    server.close();
  });
  await server.connect(transport);
  await transport.handleRequest(req, res, body);
});

const [host, port] = (process.env.ADDR ?? `127.0.0.1:${process.env.PORT ?? 3001}`).split(":");
httpServer.listen(Number(port), host, () => {
  const { address, port } = httpServer.address();
  console.log(`MCP server listening on http://${address}:${port}/mcp`);
});
