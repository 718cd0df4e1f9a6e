// A minimal A2A agent over JSON-RPC (node's standard library only): `message/send` answers
// a completed task and counts the messages it acted on; everything else is an error.
//
//   node a2a_server.js    prints "listening on http://127.0.0.1:<port>"
//
// POST /       A2A JSON-RPC
// GET  /sent   how many messages it acted on
const http = require("node:http");

let sent = 0;

const server = http.createServer((req, res) => {
  if (req.method === "GET" && req.url === "/sent") {
    res.writeHead(200, { "content-type": "application/json" });
    return res.end(JSON.stringify({ sent }));
  }
  const chunks = [];
  req.on("data", (c) => chunks.push(c));
  req.on("end", () => {
    let call;
    try {
      call = JSON.parse(Buffer.concat(chunks).toString("utf8"));
    } catch {
      call = null;
    }
    let answer;
    if (call && call.method === "message/send") {
      sent += 1; // the side effect
      const message = call.params.message;
      answer = {
        jsonrpc: "2.0",
        id: call.id,
        result: {
          kind: "task",
          id: `task-${sent}`,
          contextId: message.contextId ?? "ctx-1",
          status: { state: "completed" },
          history: [message],
        },
      };
    } else {
      const error = { code: -32601, message: "Method not found" };
      answer = { jsonrpc: "2.0", id: call?.id ?? null, error };
    }
    res.writeHead(200, { "content-type": "application/json" });
    res.end(JSON.stringify(answer));
  });
});

server.listen(0, "127.0.0.1", () => {
  console.log(`listening on http://127.0.0.1:${server.address().port}`);
});
